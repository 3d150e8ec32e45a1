"""The edges of a data-only block running on local tensors (spmd.runtime.local.blocks): its inputs' local tensors
in, each with the layout its gradient comes back in, and its outputs back into DTensors of the input's
layout. A block's output that the next block takes unchanged hands it its own local tensor: no DTensor
round trip in forward or backward between consecutive local blocks. `map_tensors` walks a model's outputs."""

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_global_tensor_info

from ..dtensor.wrap import contiguous_stride, local_of, wrap_local

__all__ = ["to_local", "from_local", "batch_grad_layout", "wrap_outputs", "map_tensors"]


def to_local(x, partial_axes: tuple = ()):
    """`x`'s local tensor, its gradient back in `x`'s layout (partial over `partial_axes` where `x` is replicated)."""
    if not isinstance(x, DTensor):
        if isinstance(x, (tuple, list)):
            return type(x)(to_local(v, partial_axes) for v in x)
        return x
    if not x.requires_grad:  # (RoPE tables, token ids): no gradient to lay out, no autograd node
        return local_of(x)
    layout = batch_grad_layout(x.placements, partial_axes) if partial_axes else tuple(x.placements)
    made = getattr(x, _MADE_FROM_ATTR, None)
    if made is not None and made[1] == layout and x.grad_fn is made[2] and x._version == made[3]:
        return made[0]  # another local block's output, unchanged: its own local tensor, no round trip
    return _ToLocal.apply(x, layout)


_MADE_FROM_ATTR = "_spmd_made_from"  # on a local block's output: (its local tensor, layout, grad_fn, version)


class _ToLocal(torch.autograd.Function):
    """`x.to_local(grad_placements=layout)`, its gradient wrapped with a layout's cached spec."""

    @staticmethod
    def forward(ctx, x: DTensor, layout):
        local = local_of(x)
        ctx.mesh, ctx.layout, ctx.shape, ctx.stride, ctx.local_stride = (
            x.device_mesh,
            layout,
            x.shape,
            x.stride(),
            local.stride(),
        )
        ctx.set_materialize_grads(False)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None
        stride = (
            ctx.stride if g.stride() == ctx.local_stride else compute_global_tensor_info(g, ctx.mesh, ctx.layout)[1]
        )
        return wrap_local(g, ctx.mesh, ctx.layout, ctx.shape, stride), None


class _FromLocal(torch.autograd.Function):
    """`DTensor.from_local(t, mesh, layout, run_check=False, shape=, stride=)` with a layout's cached spec; its
    backward returns the gradient's local tensor, moved to `layout` first if it arrives in another."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, layout, shape, stride):
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        # the constructor alone, as wrap_local: DTensor.__init__ only adds two Python wrappers
        return wrap_local(t.view_as(t), mesh, layout, shape, stride, requires_grad=t.requires_grad)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None, None, None
        if tuple(g.placements) != ctx.layout:
            g = g.redistribute(placements=ctx.layout)
        return local_of(g), None, None, None, None


from_local = _FromLocal.apply  # (t, mesh, layout, shape, stride)


def batch_grad_layout(placements, partial_axes: tuple) -> tuple:
    """`placements` with Partial on the replicated mesh axes in `partial_axes` (those that split the batch)."""
    return tuple(Partial() if (s and p.is_replicate()) else p for s, p in zip(partial_axes, placements))


def wrap_outputs(output, mesh, layout, batch):
    local_batch, global_batch = batch

    def wrap(t):
        if isinstance(t, DTensor):
            return t
        if t.ndim and t.shape[0] == local_batch:
            shape = torch.Size((global_batch, *t.shape[1:]))
            out = from_local(t, mesh, layout, shape, contiguous_stride(shape))
            if out.requires_grad:  # the next local block takes `t` back (`to_local`): gradients meet in it
                setattr(out, _MADE_FROM_ATTR, (t, layout, out.grad_fn, out._version))
            return out
        raise ValueError(
            f"a block running on local tensors returned a tensor of shape {tuple(t.shape)} whose dim 0 "
            f"is not the batch ({local_batch} on this rank); a block's outputs must lead with the "
            f"batch dim. Pass parallelize(..., bucket=False) to run it on DTensors"
        )

    return map_tensors(output, wrap)


def map_tensors(output, fn):
    """`fn` applied to the tensors of a model output (tensor, mapping, tuple or list, one level), container kept."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, dict):
        for k in list(output.keys()):
            if isinstance(output[k], torch.Tensor):
                output[k] = fn(output[k])
        return output
    if isinstance(output, (tuple, list)):
        items = [fn(v) if isinstance(v, torch.Tensor) else v for v in output]
        if isinstance(output, list):
            return items
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    return output
