"""Gradient accumulation through compiled blocks: a compiled graph cannot read a no_sync gradient in `p.grad`, so while
micro-batches accumulate (`state.accumulating`, one graph each way) the graphs leave gradients unreduced and the
last micro-batch's backward reduces the sums once, in flat buffers (gradients.step_reduce), as eager's no_sync does.
"""

import torch

from ..activations.moves import map_tensors
from ..dtensor.stack import after_backward
from .layouts import grads_layout, held_for_step
from .step_reduce import reduce_grads

__all__ = ["reduce_after_backward"]


def reduce_after_backward(output, state):
    """`output` whose backward queues, once, the reduction of the compiled blocks' accumulated gradients."""
    once = []
    return map_tensors(output, lambda t: _QueueReduction.apply(t, state, once) if t.requires_grad else t)


class _QueueReduction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, state, once: list):
        ctx.state, ctx.once = state, once
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if not ctx.once:
            ctx.once.append(True)
            state = ctx.state  # the flag holds until then: a checkpointed block's recompute reads it
            after_backward(lambda: reduce_accumulated(state))
        return g, None, None


@torch.no_grad()
def reduce_accumulated(state) -> None:
    """The compiled blocks' accumulated gradients -> the grads map's layout (those a ZeRO-1 step reduces stay)."""
    params = [
        p
        for p in state.compiled_params
        if p.grad is not None and not held_for_step(p) and tuple(p.grad.placements) != grads_layout(p)
    ]
    reduce_grads(
        params,
        [grads_layout(p) for p in params],
        state.reduce_dtype,
        "backward",
        "reduce accumulated gradients of compiled blocks",
        state.wire,
    )
    state.accumulating = False
