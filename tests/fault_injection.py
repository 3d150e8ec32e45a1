"""Deterministic faults for the tests of the trainer's failure behaviour, installed by patching the trainer's
and the checkpoint writer's own functions: the product code holds no test branch.

    before_step(RANK, STEP, KIND)  before step STEP (1 = the first), rank RANK
                                   exit: ends at once with status 1 (a crash)
                                   kill: sends itself SIGKILL
                                   hang: stops responding (sleeps until killed)
                                   Fires on torchrun's first attempt only, so a restarted group runs through;
                                   and once that rank's checkpoint in flight (--ckpt-async) is committed, so
                                   the fault lands between steps, never inside a save.
    nan_steps({3, 4}, rank=R, micro=M)
                                   the loss of these steps is multiplied by NaN (no pp): on every rank, or on
                                   rank R only; in every micro-batch, or in the M-th (0-based) of each step only
    kill_after_files(N)            the process SIGKILLs itself right after it has written its N-th checkpoint
                                   file (rank files, meta.json and index.json, in that order, over its life)

Each takes `patch(obj, name, value)`: pytest's `monkeypatch.setattr` in a test, `setattr` in a child
process (tests/fault_train.py).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time

import torch.distributed as dist

import launch.train
from launch.profile import StepProfiler
from spmd.checkpoint import AsyncSaver

_save = importlib.import_module("spmd.checkpoint.save")  # the package's `save` attribute is the function


def _before_each_step(patch, action) -> None:
    """Runs `action(step)` before each step of the loop (where the profiler opens a step)."""
    original = StepProfiler.before

    def before(self, step):
        action(step)
        original(self, step)

    patch(StepProfiler, "before", before)


def before_step(patch, rank: int, step: int, kind: str) -> None:
    if kind not in ("exit", "kill", "hang"):
        raise ValueError(f"fault kind {kind!r}: must be exit, kill or hang")
    savers: list[AsyncSaver] = []
    original_save = AsyncSaver.save

    def save(self, *args, **kwargs):
        savers[:] = [self]
        return original_save(self, *args, **kwargs)

    patch(AsyncSaver, "save", save)

    def fire(now: int) -> None:
        me = dist.get_rank() if dist.is_initialized() else 0
        if now != step or me != rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        for saver in savers:
            saver.wait()
        print(f"[faults] rank {rank}: {kind} before step {step}", file=sys.stderr, flush=True)
        if kind == "exit":
            os._exit(1)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)

    _before_each_step(patch, fire)


def nan_steps(patch, steps, rank: int | None = None, micro: int | None = None) -> None:
    steps, current = set(steps), [0, 0]  # the step, the forward calls in it
    _before_each_step(patch, lambda step: current.__setitem__(slice(None), [step, 0]))
    build_model = launch.train.build_model

    def poison(module, inputs, loss):
        forward, current[1] = current[1], current[1] + 1
        me = dist.get_rank() if dist.is_initialized() else 0
        hit = current[0] in steps and rank in (None, me) and micro in (None, forward)
        return loss * float("nan") if hit else loss

    def build(*args, **kwargs):
        built = build_model(*args, **kwargs)
        built[0].register_forward_hook(poison)
        return built

    patch(launch.train, "build_model", build)


def kill_after_files(patch, files: int) -> None:
    written = [0]

    def count(write):
        def counted(*args, **kwargs):
            out = write(*args, **kwargs)
            written[0] += 1
            if written[0] == files:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return counted

    patch(_save, "_write_rank_file", count(_save._write_rank_file))
    patch(_save, "_write_json", count(_save._write_json))
