"""Plans the search derives from plans it already has, instead of dry-running them: full activation
checkpointing from the plan without it and one dry run of a 1-block copy; ZeRO 2 from ZeRO 1 and ZeRO 3.

A model of L identical blocks plans as `one + (L-1) x block` (summaries.planned: `one` is the 1-block copy,
`block` what a second block adds). Checkpointing every block changes two things, both per block:
- what a block saves and moves on the activation side: its saved activations shrink to its input, and
  backward replays its forward (the tensor/sequence/context-parallel collectives again). The part of the
  model outside the blocks does the same with or without it, so the 1-block copy's change, `one_full -
  one_none`, is exactly one block's change;
- how a block's backward regather is issued: without checkpointing it is prefetched behind the backward of
  the block after it; with it, the regather happens inside the recomputation, on the critical path (a
  `gather`, spmd.runtime.parameters.buckets; summaries.checkpointed moves the same for `selective:N`).
So `block_full = regathered(block_none) + (one_full - one_none)` and the plan is `one_full + (L-1) x
block_full`: one dry run (the 1-block copy under `full`) where the 2-block copy took two.
tests/test_search.py compares it with explain's plan of the whole model under `full`.

ZeRO 2 differs from ZeRO 1 only in where gradients live (the grads map adds `embed->fsdp`): its parameters,
their gathers (the all-gather of the updated parameters after the step), the optimizer states and the
activations (each block saves its compute-dtype parameters, replicated over fsdp at both stages) are ZeRO 1's;
its gradients and their reduction (a reduce-scatter per gradient bucket as backward produces them, held unreduced
in the compute layout under no_sync) are ZeRO 3's, whose grads map is the same. So a mesh's ZeRO 2 plan is ZeRO 1's
with ZeRO 3's `reduce` groups and gradient bytes (`zero2_from`): no dry run of its own, and none of the
optimizer step that ZeRO 1/2 dry runs spend most of their time in twice. tests/test_search.py compares it with
explain's plan at ZeRO 2.
"""

from __future__ import annotations

from .summaries import EMPTY_GROUP, Summary

__all__ = ["full_from_none", "regathered", "same_plan", "zero2_from"]


def regathered(s: Summary) -> Summary:
    """`s` with every backward regather that was prefetched counted as a `gather` on the critical path."""
    groups: dict = {}
    for (axes, cls, kind), g in s.groups.items():
        key = (axes, "gather" if cls == "prefetch-backward" else cls, kind)
        groups[key] = [a + b for a, b in zip(groups.get(key, EMPTY_GROUP), g)]
    return Summary(groups, dict(s.memory))


def full_from_none(none, one_full):
    """The plan under full checkpointing from `none` (summaries.planned with `.block`) and the plan of its
    1-block copy under full (planned(block=ONE_BLOCK)). An error planning either is returned as it is; a model
    without a repeated block share is its own 1-block copy."""
    if isinstance(none, Exception) or isinstance(one_full, Exception) or none.block is None:
        return none if isinstance(none, Exception) else one_full
    repeats = none.blocks - 1
    one_none = none - none.block * repeats
    block = regathered(none.block) + (one_full - one_none)
    out = one_full + block * repeats
    out.block, out.blocks = block, none.blocks
    return out


def same_plan(a, b) -> bool:
    """Whether two plans (or errors) agree: every collective group that holds any, and every memory figure."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return False
    used = lambda s: {g: v for g, v in s.groups.items() if any(v)}  # noqa: E731
    return used(a) == used(b) and a.memory == b.memory


def zero2_from(zero1, zero3):
    """The ZeRO 2 plan of a mesh from its ZeRO 1 and ZeRO 3 plans (same checkpointing, micro-batches and batch):
    ZeRO 1's with ZeRO 3's gradient reductions and gradient bytes, block share likewise. An error planning
    either is returned as it is (ZeRO 1's first)."""
    for s in (zero1, zero3):
        if isinstance(s, Exception):
            return s
    groups = {g: list(v) for g, v in zero1.groups.items() if g[1] != "reduce"}
    groups.update((g, list(v)) for g, v in zero3.groups.items() if g[1] == "reduce")
    memory = {**zero1.memory, "gradients": zero3.memory["gradients"]}
    memory["total"] = zero1.memory["total"] - zero1.memory["gradients"] + zero3.memory["gradients"]
    out = Summary(groups, memory, blocks=zero1.blocks)
    if zero1.block is not None and zero3.block is not None:
        out.block = zero2_from(zero1.block, zero3.block)
    return out
