"""Sharding strategies DTensor lacks: attention on CPU, batch- or head-sharded, with or without a mask (split as q
where it has the dim, whole where it broadcasts). `install` registers them.
"""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["install"]

aten = torch.ops.aten


def _mask(attn_mask, dim):
    if attn_mask is None:
        return None
    if dim is None:
        return Replicate()
    return Shard(dim) if attn_mask.ndim == 4 and attn_mask.shape[dim] > 1 else Replicate()


def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    strategies = [([Replicate(), Replicate()], [Replicate()] * 3 + [None, None, _mask(attn_mask, None), None])]
    for dim in (0, 1):  # batch, heads
        strategies.append(([Shard(dim), Shard(dim)], [Shard(dim)] * 3 + [None, None, _mask(attn_mask, dim), None]))
    return strategies


def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
    strategies = [([Replicate()] * 3, [Replicate()] * 6 + [None, None, _mask(attn_mask, None), None])]
    for dim in (0, 1):
        strategies.append(([Shard(dim)] * 3, [Shard(dim)] * 6 + [None, None, _mask(attn_mask, dim), None]))
    return strategies


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
