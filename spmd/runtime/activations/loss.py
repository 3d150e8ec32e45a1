"""A model's own `F.cross_entropy` or `F.nll_loss` on DTensor logits: the mean over every rank's non-ignored tokens.

DTensor's averages the ranks' own means (wrong when ranks count different tokens) and gathers vocab-split logits.
Plain means go to kernels.vocab_parallel_cross_entropy; with label smoothing, class weights or `nll_loss` the sum
goes through DTensor, divided by the global count (or weight sum). Logits [B, V, T] become [B * T, V] rows first.
"""

import inspect

import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from kernels.vocab_parallel import vocab_parallel_cross_entropy

__all__ = ["FUNCS", "global_mean"]

_SIGNATURES = {f: inspect.signature(f) for f in (F.cross_entropy, F.nll_loss)}
FUNCS = frozenset(_SIGNATURES)


def global_mean(func, args, kwargs):
    """The global mean of `func(*args, **kwargs)` (one of FUNCS) on DTensor logits; None where it does not apply."""
    a = _SIGNATURES[func].bind(*args, **kwargs).arguments
    logits, targets = a["input"], a["target"]
    if (
        a.get("reduction", "mean") != "mean"
        or a.get("size_average") is not None
        or a.get("reduce") is not None
        or not isinstance(logits, DTensor)
        or logits.ndim < 2
        or any(p.is_partial() for p in logits.placements)
        or targets.ndim != logits.ndim - 1
        or targets.dtype.is_floating_point
    ):
        return None
    if logits.ndim > 2:  # [B, V, d1, ...] against [B, d1, ...]: one row of classes per position
        logits, targets = logits.movedim(1, -1).reshape(-1, logits.shape[1]), targets.reshape(-1)
    ignore_index, weight = a.get("ignore_index", -100), a.get("weight")
    smoothing = {"label_smoothing": a.get("label_smoothing", 0.0)} if func is F.cross_entropy else {}
    if func is F.cross_entropy and not smoothing["label_smoothing"] and weight is None:
        return vocab_parallel_cross_entropy(logits, targets, ignore_index)
    total = func(logits, targets, weight=weight, ignore_index=ignore_index, reduction="sum", **smoothing)
    counted = targets != ignore_index
    if weight is None:
        return total / counted.sum()
    # each counted token weighs its target's class weight (an ignored one looks up class 0, then counts 0)
    weights = F.embedding(targets.masked_fill(~counted, 0), weight.unsqueeze(1)).squeeze(1)
    return total / (weights * counted).sum()
