"""DTensor internals, in one room: the op handlers and strategies spmd adds (`install`), DTensors around local tensors
without `from_local`'s per-call work (wrap), redistribution planning kept per process (planning) and each op's
strategy chosen from the candidates that decide it (selection), the reach into torch's mode stack and autograd
engine (stack), and `destroy_process_group` waiting for registered work (teardown).

Importing spmd changes nothing in torch: `install()` (called by `parallelize`, `explain`, `AsyncSaver`) does it,
idempotently.
"""

from . import detach, fused_step, planning, strategies, teardown

__all__ = ["install"]


def install() -> None:
    """Registers spmd's DTensor op handlers and strategies, the kept planning and the teardown wait."""
    for module in (detach, fused_step, strategies, planning, teardown):
        module.install()
