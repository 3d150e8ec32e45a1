"""The two redistributions the pass plans, as autograd functions whose backward is planned too.

`move(x, placements)` changes an activation's layout; its backward brings the gradient back to the
layout `x` had (a Partial source gets a Replicate gradient: every partial sum sees the whole gradient).
`gather_param(p, placements)` brings a parameter from its storage layout to its compute layout (cast to
the compute dtype first, so an FSDP gather moves bf16); its backward casts the gradient to the reduce
dtype and reduces it into the storage layout: all-reduce over replicated axes, reduce-scatter over
sharded ones. Under `no_sync` the gradient stays unreduced until the step that syncs.
"""
import functools

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import record


def _grad_layout(placements):
    return tuple(Replicate() if p.is_partial() else p for p in placements)


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, placements, grad_placements, module, why):
        ctx.src = _grad_layout(x.placements) if grad_placements is None else tuple(grad_placements)
        ctx.module, ctx.why = module, why
        if tuple(x.placements) == tuple(placements):
            return x.view_as(x)
        with record.reason(module, why):
            return x.redistribute(placements=placements)

    @staticmethod
    def backward(ctx, g: DTensor):
        if tuple(g.placements) != ctx.src:
            with record.reason(ctx.module, f"backward of {ctx.why}"):
                g = g.redistribute(g.device_mesh, ctx.src)
        return g, None, None, None, None


def move(x: DTensor, placements, module: str, why: str, grad_placements=None) -> DTensor:
    """Redistributes `x` to `placements`. `grad_placements` overrides the gradient's layout on the way back."""
    placements = tuple(placements)
    if tuple(x.placements) == placements and (grad_placements is None or torch.compiler.is_compiling()):
        return x
    if torch.compiler.is_compiling():
        # DTensor's own redistribute traces to functional collectives; its backward brings the gradient
        # back to x's layout (Partial sources get Replicate), the same layout _Move's backward gives
        return x.redistribute(placements=placements)
    if not x.requires_grad:
        if tuple(x.placements) == placements:
            return x
        with record.reason(module, why):
            return x.redistribute(placements=placements)
    return _Move.apply(x, placements, grad_placements, module, why)


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: DTensor, placements, dtype, reduce_dtype, state, module, name):
        ctx.p, ctx.storage = p, tuple(p.placements)
        ctx.reduce_dtype, ctx.state, ctx.module, ctx.name = reduce_dtype, state, module, name
        x = p if dtype is None or p.dtype == dtype else p.to(dtype)
        if tuple(x.placements) == tuple(placements):
            return x.view_as(x) if x is p else x
        with record.reason(module, f"gather {name} to its compute layout"):
            return x.redistribute(placements=placements)

    @staticmethod
    def backward(ctx, g: DTensor):
        p = ctx.p
        if ctx.reduce_dtype is not None and g.dtype != ctx.reduce_dtype:
            g = g.to(ctx.reduce_dtype)
        if not ctx.state.sync:
            return g.to(p.dtype), None, None, None, None, None, None
        g = join_unreduced(p, g)
        if tuple(g.placements) != ctx.storage:
            with record.reason(ctx.module, f"reduce gradient of {ctx.name} to its storage layout"):
                g = reduce_to(g, ctx.storage)
        return g.to(p.dtype), None, None, None, None, None, None


def reduce_to(g: DTensor, storage) -> DTensor:
    """Redistributes a gradient to `storage` in the order that moves fewest bytes: slice replicated dims
    (free), then reduce-scatter partial sums onto sharded dims, then all-reduce what stays replicated
    (HSDP all-reduces the fsdp shard over dp, not the whole gradient)."""
    g = slice_onto_shards(g, storage)
    step = tuple(s if c.is_partial() and s.is_shard() else c for c, s in zip(g.placements, storage))
    if step != tuple(g.placements):
        g = g.redistribute(g.device_mesh, step)
    if tuple(g.placements) != tuple(storage):
        g = g.redistribute(g.device_mesh, storage)
    return g


def slice_onto_shards(g: DTensor, storage) -> DTensor:
    """`g` with its replicated dims that `storage` shards sliced locally (free: no communication)."""
    step = tuple(s if c.is_replicate() and s.is_shard() else c for c, s in zip(g.placements, storage))
    return g.redistribute(g.device_mesh, step) if step != tuple(g.placements) else g


def join_unreduced(p, g: DTensor) -> DTensor:
    """`g` plus the gradient `p` accumulated unreduced under no_sync, which then leaves `p.grad`: both are
    reduced together, once."""
    if p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
        g = g + p.grad.to(g.dtype)
        p.grad = None
    return g


def gather_param(p, placements, dtype, reduce_dtype, state, module: str, name: str) -> DTensor:
    if torch.compiler.is_compiling():
        # Inside a compiled block: DTensor's redistribute, whose backward reduces the gradient to the
        # storage layout in `reduce_dtype` (all-reduce / reduce-scatter, visible to the compiler). Gradients
        # are reduced on every backward here: no_sync does not apply inside compiled blocks.
        return checkpoint(_redistribute_param, p, tuple(placements), dtype, reduce_dtype, use_reentrant=False,
                          context_fn=_recompute_in_backward)
    return _GatherParam.apply(p, tuple(placements), dtype, reduce_dtype, state, module, name)


def _redistribute_param(p, placements, dtype, reduce_dtype):
    return p.redistribute(placements=placements, forward_dtype=dtype, backward_dtype=reduce_dtype)


def _always_recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


# ZeRO-3 under the compiler: the gathered parameter is recomputed (regathered) in backward, not saved
_recompute_in_backward = functools.partial(create_selective_checkpoint_contexts, _always_recompute)
