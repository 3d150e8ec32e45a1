"""Attention's memory per rank, observed while it runs: bytes saved for backward and peak allocation (under cp, the
ring's blocks in flight and scores). `observe(record)` around a step collects them from every `attending` call:
saved bytes through the activation-counting hook, the peak by a dispatch mode that holds on fake tensors too.
"""

import contextlib
import weakref

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..dtensor.wrap import local_of

__all__ = ["observe", "attending", "attending_now", "note_saved"]

_records: list[dict] = []
_depth = 0


def attending_now() -> bool:
    """Whether an attention call observed by `observe` is running."""
    return _depth > 0


@contextlib.contextmanager
def observe(record: dict):
    """Fills `record` while open: "saved" ({storage: bytes} attention saved for backward) and "peak" (the
    most bytes one attention call held at once of the storages it allocated, its outputs included)."""
    record.setdefault("saved", {})
    record.setdefault("peak", 0)
    _records.append(record)
    try:
        yield record
    finally:
        _records[:] = [r for r in _records if r is not record]  # by identity: records compare by value


def note_saved(key: int, nbytes: int) -> None:
    """Counts a storage autograd saves as attention's when an attention call is running."""
    if _depth:
        for r in _records:
            r["saved"][key] = nbytes


def attending(call, *args, **kwargs):
    """`call(*args, **kwargs)`, observed when someone observes (no context manager: compiled blocks trace through)."""
    global _depth
    if not _records:
        return call(*args, **kwargs)
    tracker = _LiveBytes()
    _depth += 1
    try:
        with tracker:
            return call(*args, **kwargs)
    finally:
        _depth -= 1
        for r in _records:
            r["peak"] = max(r["peak"], tracker.peak)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated under this mode still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(a)._cdata for a in tree_leaves((args, kwargs)) if _is_tensor(a)}
        for t in tree_leaves(out):
            if not _is_tensor(t):
                continue
            storage = _storage(t)
            key = storage._cdata
            if key in inputs or key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self.now += self.live[key]
            self.peak = max(self.peak, self.now)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)


def _is_tensor(t) -> bool:
    return hasattr(t, "untyped_storage")


def _storage(t):
    return local_of(t).untyped_storage()
