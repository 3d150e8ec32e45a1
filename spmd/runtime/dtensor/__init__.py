"""DTensor internals, in one room: the op handlers and sharding strategies spmd adds to DTensor (`install`),
DTensor construction around local tensors without `from_local`'s per-call work (wrap), and the reach into
torch's torch-function mode stack and autograd engine (stack). The rest of the runtime speaks DTensor's public
API or these functions.

Importing spmd changes nothing in torch: `install()`, which `spmd.parallelize` and `spmd.explain` call, registers
the handlers (idempotent).
"""

from . import detach, fused_step, strategies

__all__ = ["install"]


def install() -> None:
    """Registers spmd's DTensor op handlers (detach, the fused Adam/AdamW step) and attention strategies."""
    detach.install()
    fused_step.install()
    strategies.install()
