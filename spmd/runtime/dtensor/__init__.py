"""DTensor internals, in one room: the op handlers and strategies spmd adds (`install`), DTensors around local tensors
without `from_local`'s per-call work (wrap), redistribution planning kept per process (planning), the reach into
torch's mode stack and autograd engine (stack), and `destroy_process_group` waiting for registered work (teardown).

Importing spmd changes nothing in torch: `install()` (called by `parallelize`, `explain`, `AsyncSaver`) does it,
idempotently.
"""

from . import detach, fused_step, planning, strategies, teardown

__all__ = ["install"]


def install() -> None:
    """Registers spmd's DTensor op handlers (detach, the fused Adam/AdamW step) and attention strategies, keeps
    DTensor's redistribution planning (planning), and makes `destroy_process_group` wait for the registered
    teardown work."""
    detach.install()
    fused_step.install()
    strategies.install()
    planning.install()
    teardown.install()
