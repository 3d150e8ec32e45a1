"""Collectives timed inside real steps: the recorder's records, each with the wall-clock seconds it took.

`TimedRecorder` is a `CollectiveRecorder` that waits for each collective where it is issued, so `seconds[i]`
(one entry per record) runs from the issue of `records[i]` to its completion: its transfer and the wait for
the slowest rank of its group to arrive, not what the rank computes between the issue and the runtime's own
wait (functional collectives' `wait_tensor`, a c10d work's `wait()`, which then find it done). Waiting at the
issue serialises what the runtime would overlap with compute; the step-time model prices collectives the same
way where nothing overlaps (`Device.overlaps_comm` is off on a CPU whose ranks outnumber its cores), and the
step it records is a sample of collectives, not a step time to report.

`samples` turns a recorder's records into the rows `benchmarks.search_vs_measured` fits link figures to.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .record import CollectiveRecorder, ring_steps
from .summaries import traffic

__all__ = ["TimedRecorder", "samples"]

_wait_tensor = torch.ops._c10d_functional.wait_tensor


def _wait(out) -> None:
    """Blocks until the collective that returned `out` completed: a c10d op returns its Work (alone or last in
    a tuple), a functional collective its output tensor, registered with the work writing it."""
    work = out[-1] if isinstance(out, (tuple, list)) and out else out
    if isinstance(work, torch.ScriptObject):
        dist.distributed_c10d.Work.unbox(work).wait()
    elif isinstance(out, torch.Tensor):
        _wait_tensor(out)


class TimedRecorder(CollectiveRecorder):
    """Records collectives like `CollectiveRecorder`, and in `seconds` each one's issue-to-completion time."""

    def __init__(self, mesh=None):
        super().__init__(mesh)
        self.seconds: list[float] = []  # the base class records every collective it issues, in this order

    def _issue(self, func, args, kwargs):
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        _wait(out)
        self.seconds.append(time.perf_counter() - t0)
        return out


def samples(recorder: TimedRecorder, sizes: dict, seconds: list | None = None) -> list[dict]:
    """One row per timed collective over more than one rank: kind, ranks (the product of its mesh axes'
    `sizes`), ring steps, wire bytes (record.py's convention), seconds (`seconds` where given: e.g. the median
    over ranks of each record's time), and its traffic class (summaries.traffic)."""
    rows = []
    for c, s in zip(recorder.records, recorder.seconds if seconds is None else seconds):
        n = math.prod(sizes.get(a, 1) for a in c.axes)
        if n > 1 and c.kind != "recv":
            row = {"kind": c.kind, "ranks": n, "steps": ring_steps(c.kind, n), "wire_bytes": c.bytes}
            rows.append(row | {"seconds": s, "traffic": traffic(c)})
    return rows
