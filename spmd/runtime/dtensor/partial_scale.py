"""A partial sum times a constant scalar stays a partial sum.

Gemma scales its vocab-split embedding (partial sums under tp) by a 0-d buffer; DTensor treats that multiply as
nonlinear and reduces first, into a layout of its own choosing that the model then follows. Scaling each summand
keeps the partial sums for the pass to reduce where it plans to.
"""

import torch
from torch.distributed.tensor import DTensor

from .wrap import local_of, wrap_local

__all__ = ["MULTIPLIES", "scale_partial"]

MULTIPLIES = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}


def scale_partial(a, b) -> DTensor | None:
    """`a * b` of a partial-sum DTensor and a constant scalar tensor, kept partial; None otherwise."""
    for x, s in ((a, b), (b, a)):
        if (
            isinstance(x, DTensor)
            and any(p.is_partial() and getattr(p, "reduce_op", "sum") == "sum" for p in x.placements)
            and isinstance(s, torch.Tensor)
            and s.numel() == 1
            and not s.requires_grad
            and (not isinstance(s, DTensor) or all(p.is_replicate() for p in s.placements))
        ):
            return _ScalePartial.apply(x, local_of(s))
    return None


class _ScalePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, s: torch.Tensor):
        ctx.s = s
        local = local_of(x) * s
        return wrap_local(local, x.device_mesh, x.placements, x.shape, local.stride())

    @staticmethod
    def backward(ctx, g):
        local = local_of(g) * ctx.s
        return wrap_local(local, g.device_mesh, g.placements, g.shape, local.stride()), None
