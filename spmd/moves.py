"""The two redistributions the pass plans, as autograd functions whose backward is planned too.

`move(x, placements)` changes an activation's layout; its backward brings the gradient back to the
layout `x` had (a Partial source gets a Replicate gradient: every partial sum sees the whole gradient).
`gather_param(p, placements)` brings a parameter from its storage layout to its compute layout (cast to
the compute dtype first, so an FSDP gather moves bf16); its backward casts the gradient to the reduce
dtype and reduces it into the storage layout: all-reduce over replicated axes, reduce-scatter over
sharded ones. Under `no_sync` the gradient stays unreduced until the step that syncs.
"""
import torch
from torch.distributed.tensor import DTensor, Replicate

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
            return x.redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, g: DTensor):
        if tuple(g.placements) != ctx.src:
            with record.reason(ctx.module, f"backward of {ctx.why}"):
                g = g.redistribute(g.device_mesh, ctx.src)
        return g, None, None, None, None


def move(x: DTensor, placements, module: str, why: str, grad_placements=None) -> DTensor:
    """Redistributes `x` to `placements`. `grad_placements` overrides the gradient's layout on the way back."""
    placements = tuple(placements)
    if tuple(x.placements) == placements and grad_placements is None:
        return x
    if not x.requires_grad:
        if tuple(x.placements) == placements:
            return x
        with record.reason(module, why):
            return x.redistribute(x.device_mesh, placements)
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
            return x.redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, g: DTensor):
        p = ctx.p
        if ctx.reduce_dtype is not None and g.dtype != ctx.reduce_dtype:
            g = g.to(ctx.reduce_dtype)
        if not ctx.state.sync:
            return g.to(p.dtype), None, None, None, None, None, None
        if p.grad is not None and tuple(p.grad.placements) != ctx.storage:
            # gradients accumulated unreduced under no_sync join this reduction
            g = g + p.grad.to(g.dtype)
            p.grad = None
        if tuple(g.placements) != ctx.storage:
            with record.reason(ctx.module, f"reduce gradient of {ctx.name} to its storage layout"):
                g = reduce_to(g, ctx.storage)
        return g.to(p.dtype), None, None, None, None, None, None


def reduce_to(g: DTensor, storage) -> DTensor:
    """Redistributes a gradient to `storage` in the order that moves fewest bytes: slice replicated dims
    (free), then reduce-scatter partial sums onto sharded dims, then all-reduce what stays replicated
    (HSDP all-reduces the fsdp shard over dp, not the whole gradient)."""
    for stage in (lambda c, s: c.is_replicate() and s.is_shard(), lambda c, s: c.is_partial() and s.is_shard()):
        step = tuple(s if stage(c, s) else c for c, s in zip(g.placements, storage))
        if step != tuple(g.placements):
            g = g.redistribute(g.device_mesh, step)
    if tuple(g.placements) != tuple(storage):
        g = g.redistribute(g.device_mesh, storage)
    return g


def gather_param(p, placements, dtype, reduce_dtype, state, module: str, name: str) -> DTensor:
    return _GatherParam.apply(p, tuple(placements), dtype, reduce_dtype, state, module, name)
