"""Knowing a step before running it: the collective recorder, fake worlds, `explain` and its `Plan`, the
device table, and the spec search built on them."""

from .explain import explain
from .plan import Plan
from .record import Collective, CollectiveRecorder

__all__ = ["explain", "Plan", "Collective", "CollectiveRecorder"]
