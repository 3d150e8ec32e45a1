"""A model's own `F.cross_entropy` or `F.nll_loss` on DTensor logits: the mean over every rank's non-ignored
tokens.

DTensor's cross-entropy on logits split along the tokens averages the ranks' own means. Where the ranks hold
different numbers of tokens the loss counts (padding, prompts masked out with ignore_index), that is not
the one-device loss, and its gradients are not the one-device gradients; on logits split along the vocab it
gathers them whole first. While a parallelized model runs, a mean over class-index targets (transformers'
loss, nanoGPT's) goes to kernels.vocab_parallel_cross_entropy instead, as models.llama's loss does: the
loss sum and the count of non-ignored tokens are summed over the ranks, and vocab-split logits stay split.
With label smoothing or class weights, and for `F.nll_loss` on log-probabilities, the sum goes through DTensor
and is divided by what one device divides it by: the count of every rank's non-ignored tokens, or the sum of
their targets' weights. Logits with the class dim second and more dims after it ([B, V, T], as
`F.cross_entropy` takes them) become [B * T, V] rows first.
"""

import inspect

import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from kernels.vocab_parallel import vocab_parallel_cross_entropy

__all__ = ["FUNCS", "global_mean"]

_SIGNATURES = {f: inspect.signature(f) for f in (F.cross_entropy, F.nll_loss)}
FUNCS = frozenset(_SIGNATURES)


def global_mean(func, args, kwargs):
    """The global mean of `func(*args, **kwargs)` (a function of FUNCS) on DTensor logits or log-probabilities;
    None where it does not apply (another reduction, probability targets, logits still partial sums), for the
    caller to run the op as is."""
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
    # each counted token weighs its target's class weight (an ignored one looks up class 0, then counts 0); a
    # plain weight tensor arrives replicated, as the global view wraps every plain tensor that meets a DTensor
    weights = F.embedding(targets.masked_fill(~counted, 0), weight.unsqueeze(1)).squeeze(1)
    return total / (weights * counted).sum()
