"""A clean stop: the first SIGTERM/SIGINT asks the trainer to finish its step, checkpoint and exit; a second one
interrupts at once. Every rank stops after the same step, whichever of them got the signal."""

import signal
import sys

import torch
import torch.distributed as dist

__all__ = ["StopRequest", "stop_everywhere"]


class StopRequest:
    """Signal flag: the first SIGTERM/SIGINT asks for a clean stop, a second one interrupts."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\n[launch.train] got {signal.Signals(signum).name}: finishing the step, then checkpoint and exit",
            file=sys.stderr,
            flush=True,
        )

    def uninstall(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def stop_everywhere(flag: bool, device, *more: bool) -> bool | tuple[bool, ...]:
    """True on every rank when any rank's flag is set (one all-reduce); with `more` flags, one answer per flag
    from the same all-reduce."""
    flags = (flag, *more)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = tuple(bool(v) for v in t.tolist())
    return flags if more else flags[0]
