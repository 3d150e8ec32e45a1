"""Pipeline candidates of the search: a spec with a pp axis is planned whole by `explain` (its stages hold
different blocks, so the 1- and 2-block extrapolation does not apply), with its schedule and micro-batches, as
spmd/analysis/explain_pipeline.py plans a pipeline: the records and memory of the pp rank whose memory is
largest, and the schedule's bubble.

Step time: the pp rank's work (compute / world of the step's FLOPs, recompute, its collectives, sends and
receives) is spread over its m micro-batches; the schedule idles a fraction `bubble` of the step
(spmd.pipeline.runtime.bubble_fraction, (p-1)/(m+p-1) for 1F1B), so step = work / (1 - bubble).
Activation checkpointing is `none` or `full` (the least of the two that fits, or the pinned one); gradient
accumulation is the pipeline's own micro-batches (--grad-accum 1)."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.runtime import default_microbatches
from .explain import explain
from .summaries import rules_for, summarize

__all__ = ["Pipeline", "plan_pipeline", "pipeline_sizes"]


@dataclass(frozen=True)
class Pipeline:
    """How pipeline specs run: launch.train's --pp-schedule, --microbatches (0: the schedule's default)."""

    schedule: str = "1f1b"
    microbatches: int = 0

    def microbatches_for(self, pp: int) -> int:
        return self.microbatches or default_microbatches(self.schedule, pp)


def pipeline_sizes(world: int, n_blocks: int, max_pp: int) -> list[int]:
    """pp sizes worth trying: 2..max_pp dividing the world and leaving each stage at least one block."""
    return [pp for pp in range(2, max_pp + 1) if world % pp == 0 and pp <= n_blocks]


def plan_pipeline(net, key, shape, budget: float, modes: list[str], how: Pipeline):
    """(Summary or error, ac, 1, pipeline section) for a pp candidate `key` (frozen sizes, sp, zero): the
    first of `modes` ("none", "full") whose plan fits `budget`, else the last."""
    sizes, sp, zero = dict(key[0]), key[1], key[2]
    batch, seq, dtype = shape
    out = None
    for mode in modes:
        try:
            plan = explain(
                net,
                rules_for(sp, zero),
                sizes,
                batch_shape=(batch, seq),
                dtype=dtype,
                ac=mode,
                schedule=how.schedule,
                microbatches=how.microbatches_for(sizes["pp"]),
            )
        except (ValueError, RuntimeError) as e:
            return ValueError(next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)), mode, 1, {}
        out = (summarize(plan), mode, 1, plan.pipeline)
        if out[0].memory["total"] <= budget:
            break
    return out
