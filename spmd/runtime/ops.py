"""Sharding strategies DTensor lacks: attention on CPU (batch- or head-sharded attention is local)."""
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__: list[str] = []  # importing this module registers the strategies

aten = torch.ops.aten


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    strategies = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None, None, None])]
    if attn_mask is None:
        for dim in (0, 1):  # batch, heads
            strategies.append(([Shard(dim), Shard(dim)], [Shard(dim)] * 3 + [None, None, None, None]))
    return strategies


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None,
                       scale=None):
    strategies = [([Replicate()] * 3, [Replicate()] * 6 + [None, None, None, None])]
    if attn_mask is None:
        for dim in (0, 1):
            strategies.append(([Shard(dim)] * 3, [Shard(dim)] * 6 + [None, None, None, None]))
    return strategies
