"""`--profile-steps A:B`: a torch.profiler trace of training steps A..B (inclusive, numbered as in the metrics,
1 = the first step), and on CUDA a memory snapshot of the same steps.

Each rank writes into `--profile-dir` (default `profile/`):
- `rank00003-steps5-7.pt.trace.json`: Chrome trace JSON (CPU ops, CUDA kernels, collectives; one
  `ProfilerStep#N` span per training step N). Open it at https://ui.perfetto.dev or chrome://tracing; TensorBoard's
  profiler plugin (`torch-tb-profiler`) reads `*.pt.trace.json` files from the directory.
- `rank00003-steps5-7.memory.pickle` (CUDA only): the allocator's history from
  `torch.cuda.memory._record_memory_history`; drop it on https://pytorch.org/memory_viz.
"""

from __future__ import annotations

from pathlib import Path

import torch


def parse_steps(spec: str) -> tuple[int, int] | None:
    """`A:B` -> (A, B) with 1 <= A <= B; empty -> None. ValueError naming the fix otherwise."""
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(
            f"--profile-steps {spec!r} is not A:B; write e.g. --profile-steps 5:7 to profile steps 5, 6 and 7"
        ) from None
    if not 1 <= a <= b:
        raise ValueError(f"--profile-steps {spec!r}: need 1 <= A <= B (steps count from 1); e.g. 5:7")
    return a, b


class StepProfiler:
    """Call `before(n)` as step n starts and `after(n)` when it is done; `after` returns the files written
    once step B is done (else [])."""

    def __init__(self, spec: str, out_dir: str, rank: int, device: torch.device):
        self.steps = parse_steps(spec)
        self.out, self.rank, self.device = Path(out_dir or "profile"), rank, device
        self.prof = self.span = None

    def _name(self, kind: str) -> Path:
        a, b = self.steps
        return self.out / f"rank{self.rank:05d}-steps{a}-{b}.{kind}"

    def before(self, step: int) -> None:
        if self.steps is None or self.prof is not None or not self.steps[0] <= step <= self.steps[1]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.start()
        self._open_span(step)

    def _open_span(self, step: int) -> None:
        # the name TensorBoard's profiler plugin splits steps by; numbered like the metrics' steps
        self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.span.__enter__()

    def _close_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def after(self, step: int) -> list[Path]:
        if self.prof is None:
            return []
        self._close_span()
        if step >= self.steps[1]:
            return self._finish()
        self._open_span(step + 1)
        return []

    def _finish(self) -> list[Path]:
        self._close_span()
        self.prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        written = [self._name("pt.trace.json")]
        self.prof.export_chrome_trace(str(written[0]))
        self.prof = None
        if self.device.type == "cuda":
            written.append(self._name("memory.pickle"))
            torch.cuda.memory._dump_snapshot(str(written[1]))
            torch.cuda.memory._record_memory_history(enabled=None)
        return written

    def close(self) -> list[Path]:
        """Writes what was recorded when the run stops before step B (a signal, fewer steps)."""
        return self._finish() if self.prof is not None else []
