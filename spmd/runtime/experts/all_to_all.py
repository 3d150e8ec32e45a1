"""`AllToAll`: all_to_all_single with variable splits, its backward the reverse exchange, each collective tagged for
explain (funcol's autograd variant carries no reason); `exchange_counts` sizes it, balanced on fake tensors.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import tags

__all__ = ["AllToAll", "balanced_counts", "exchange_counts"]


class AllToAll(torch.autograd.Function):
    """`apply(x, out_splits, in_splits, group, module, why)`: rows exchanged by split sizes; the gradient goes back."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, module, why):
        ctx.splits, ctx.group, ctx.module, ctx.why = (in_splits, out_splits), group, module, why  # back: reversed
        with tags.reason(module, why):
            return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group))

    @staticmethod
    def backward(ctx, g):
        with tags.reason(ctx.module, f"backward of {ctx.why}"):
            g = funcol.wait_tensor(funcol.all_to_all_single(g.contiguous(), *ctx.splits, ctx.group))
        return g, None, None, None, None, None


def balanced_counts(rows: int, experts: int) -> torch.Tensor:
    """Rows per expert when `rows` (token, choice) pairs spread evenly over the experts (a real tensor)."""
    with unset_fake_temporarily():
        counts = torch.full((experts,), rows // experts, dtype=torch.long)
        counts[: rows % experts] += 1
    return counts


def exchange_counts(counts: torch.Tensor, balanced: bool, group, module: str, what: str) -> tuple:
    """(rows received per [source rank, local expert], rows sent to / received from each rank, the plan's note)
    for this rank's `counts` per expert; `balanced` (explain): every rank sends what this one does."""
    n = dist.get_world_size(group)
    note = " (balanced routing assumed)" if balanced else ""
    received = torch.empty_like(counts)
    with tags.reason(module, f"exchange {what} per expert{note}"):
        dist.all_to_all_single(received, counts, group=group)
    with unset_fake_temporarily():
        if balanced:
            received = counts.view(n, -1)[dist.get_rank(group)].repeat(n)
        per_source = received.view(n, -1)
        return per_source, counts.view(n, -1).sum(1).tolist(), per_source.sum(1).tolist(), note
