"""Deterministic faults for the tests of the trainer's failure behaviour; inert unless these variables are set.

    SPMD_TEST_FAULT=RANK:STEP:KIND   before step STEP (1 = the first), rank RANK
                                     exit: ends at once with status 1 (a crash)
                                     kill: sends itself SIGKILL
                                     hang: stops responding (sleeps until killed)
                                     Fires on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT unset
                                     or 0), so a restarted group runs through; and once that rank's
                                     checkpoint in flight (--ckpt-async) is committed, so the fault lands
                                     between steps, never inside a save.
    SPMD_TEST_NAN_STEPS=3,4          the loss of these steps is multiplied by NaN on every rank (meshes
                                     without pp)

The checkpoint writer has its own: SPMD_TEST_KILL_AFTER_FILES (spmd.checkpoint.save).
"""
from __future__ import annotations

import os
import signal
import sys
import time


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def before_step(step: int, rank: int, settle=None) -> None:
    """Called with the number of the step about to run; `settle()` (if given) runs before a fault fires."""
    spec = os.environ.get("SPMD_TEST_FAULT")
    if not spec or not _first_attempt():
        return
    want_rank, want_step, kind = spec.split(":")
    if int(want_rank) != rank or int(want_step) != step:
        return
    if settle is not None:
        settle()
    print(f"[launch.faults] rank {rank}: {kind} before step {step} (SPMD_TEST_FAULT)", file=sys.stderr, flush=True)
    if kind == "exit":
        os._exit(1)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise ValueError(f"SPMD_TEST_FAULT={spec!r}: kind must be exit, kill or hang")


def nan_steps() -> set[int]:
    spec = os.environ.get("SPMD_TEST_NAN_STEPS", "")
    return {int(s) for s in spec.split(",") if s.strip()}
