"""Where partial sums are reduced, without constraint points.

A layer whose weight shards its input features (row-parallel linear, vocab-sharded embedding) yields partial
sums; the pass reduces them as it returns, into the rules' layout for its output (an all-reduce, or a
reduce-scatter over the sequence under sp), so a later `constrain` finds the layout in place.
"""

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from ...layout.annotate import get_axes, out_dim
from ...layout.rules import placements_for
from .moves import move

__all__ = ["output_axis", "token_axes", "reduce_partials"]


def output_axis(module: nn.Module) -> str | None:
    """The logical axis of the last dim of `module`'s output, from its weight's annotation."""
    dim, w = out_dim(module), module._parameters.get("weight")
    axes = get_axes(w) if w is not None else None
    return axes[dim] if dim is not None and axes and len(axes) > dim else None


def token_axes(ndim: int, last: str | None) -> tuple:
    """Logical axes of an activation of `ndim` >= 1 dims: (batch, seq, ..., last)."""
    lead = ("batch", "seq")[: ndim - 1]
    return lead + (None,) * (ndim - 1 - len(lead)) + (last,)


def reduce_partials(x, rules, module: nn.Module, name: str):
    """`x` with its partial sums reduced into the rules' layout (other mesh dims keep their placements)."""
    if not isinstance(x, DTensor) or x.ndim == 0 or not any(p.is_partial() for p in x.placements):
        return x
    axes = token_axes(x.ndim, output_axis(module))
    dims = rules.mesh_axes(axes, "compute", f"output of {name!r}", strict=False)
    target = placements_for(x.device_mesh, dims, x.shape, f"output {axes} of {name!r}")
    taken = {p.dim for p in x.placements if p.is_shard()}  # a dim sharded already keeps its one mesh axis
    final = tuple(
        p if not p.is_partial() else Replicate() if t.is_shard() and t.dim in taken else t
        for p, t in zip(x.placements, target)
    )
    return move(x, final, name, f"reduce partial sums to the rules' layout {axes}")
