"""`AllToAll`: all_to_all_single with variable splits whose backward is the reverse exchange, each
collective tagged with the module and the reason, for explain (funcol's autograd variant carries no reason)."""

import torch
import torch.distributed._functional_collectives as funcol

from .. import tags

__all__ = ["AllToAll"]


class AllToAll(torch.autograd.Function):
    """`apply(x, out_splits, in_splits, group, module, why)`: rows of `x` sent by `in_splits`, received by
    `out_splits`; the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, module, why):
        ctx.splits, ctx.group, ctx.module, ctx.why = (in_splits, out_splits), group, module, why
        with tags.reason(module, why):
            return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group))

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        with tags.reason(ctx.module, f"backward of {ctx.why}"):
            g = funcol.wait_tensor(funcol.all_to_all_single(g.contiguous(), out_splits, in_splits, ctx.group))
        return g, None, None, None, None, None
