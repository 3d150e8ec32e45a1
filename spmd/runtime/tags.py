"""Why each collective is issued: the module running, the reason the pass gives, and the training phase.

The pass wraps every redistribution it plans in `reason(module, why)` and keeps a stack of the modules
running; `spmd.analysis.record` reads these when it records a collective. Under the compiler nothing is
tagged: compiled graphs issue their collectives without a dispatch mode to see them.
"""

import contextlib
import contextvars

from .state import tracing

__all__ = [
    "reason",
    "phase",
    "push_module",
    "pop_module",
    "depth",
    "unwind_to",
    "current_module",
    "current_reason",
    "current_phase",
]

_context = contextvars.ContextVar("spmd_comm_context", default=None)  # (module, reason, origin)
_phase = contextvars.ContextVar("spmd_phase", default="forward")
_module_stack: list[str] = []


@contextlib.contextmanager
def reason(module: str, why: str, origin: str = "planned"):
    if tracing():
        yield
        return
    token = _context.set((module, why, origin))
    try:
        yield
    finally:
        _context.reset(token)


@contextlib.contextmanager
def phase(name: str):
    token = _phase.set(name)
    try:
        yield
    finally:
        _phase.reset(token)


def push_module(name: str):
    if not tracing():
        _module_stack.append(name)


def pop_module():
    if not tracing() and _module_stack:
        _module_stack.pop()


def depth() -> int:
    return len(_module_stack)


def unwind_to(n: int) -> None:
    del _module_stack[n:]


def current_module() -> str:
    """The innermost running module's name; "" under the compiler (a graph serves every block of a type)."""
    if tracing():
        return ""
    return _module_stack[-1] if _module_stack else ""


def current_reason() -> tuple | None:
    """(module, why, origin) of the innermost `reason`, or None outside every one."""
    return _context.get()


def current_phase() -> str:
    return _phase.get()
