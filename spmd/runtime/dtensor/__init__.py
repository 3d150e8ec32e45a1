"""DTensor internals, in one room: the op handlers and sharding strategies spmd adds to DTensor (`install`),
DTensor construction around local tensors without `from_local`'s per-call work (wrap), its redistribution
planning kept per process (planning), and the reach into torch's torch-function mode stack and autograd engine
(stack). The rest of the runtime speaks DTensor's public API or these functions. It is also the one place spmd
changes torch.distributed: `destroy_process_group` waits for the work registered to end first (teardown: a
checkpoint save in flight).

Importing spmd changes nothing in torch: `install()`, which `spmd.parallelize`, `spmd.explain` and
`spmd.checkpoint.AsyncSaver` call, registers the handlers and the teardown wait (idempotent).
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
