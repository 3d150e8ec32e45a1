"""Sharding strategies DTensor lacks: attention on CPU, batch- or head-sharded, with or without a mask (split as q
where it has the dim, whole where it broadcasts). `install` registers them.
"""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["install"]

aten = torch.ops.aten


def _strategies(outputs: int, inputs: int, attn_mask) -> list:
    """Replicated, batch- and head-sharded: `outputs` results and `inputs` tensors alike, then dropout_p,
    is_causal, the mask and scale."""
    strategies = []
    for dim, p in [(None, Replicate()), (0, Shard(0)), (1, Shard(1))]:
        split = dim is not None and attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[dim] > 1
        mask = None if attn_mask is None else p if split else Replicate()
        strategies.append(([p] * outputs, [p] * inputs + [None, None, mask, None]))
    return strategies


def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    return _strategies(2, 3, attn_mask)


def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
    return _strategies(3, 6, attn_mask)


_STRATEGIES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_cpu_backward,
}
_installed: list = []


def install() -> None:
    if not _installed:
        for op, strategy in _STRATEGIES.items():
            register_sharding(op)(strategy)
        _installed.append(True)
