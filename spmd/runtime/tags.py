"""Why each collective is issued: the module running, the reason the pass gives, and the training phase.

The pass wraps each redistribution in `reason(module, why)` and the hooks push each running module
(state.push); `spmd.analysis.record` reads both. Compiled graphs are not tagged (no dispatch mode sees them).
"""

import contextlib
import contextvars

from .state import current_module, tracing

__all__ = ["reason", "phase", "current_module", "current_reason", "current_phase"]

_context = contextvars.ContextVar("spmd_comm_context", default=None)  # (module, reason, origin)
_phase = contextvars.ContextVar("spmd_phase", default="forward")


def reason(module: str, why: str, origin: str = "planned"):
    return contextlib.nullcontext() if tracing() else _set(_context, (module, why, origin))


def phase(name: str):
    return _set(_phase, name)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def current_reason() -> tuple | None:
    """(module, why, origin) of the innermost `reason`, or None outside every one."""
    return _context.get()


def current_phase() -> str:
    return _phase.get()
