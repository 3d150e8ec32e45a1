"""Checkpoints written in the background: the caller waits only while its state is copied to host memory.

    saver = AsyncSaver()
    saver.save(ckpt_dir, step, model_state(model), optim_state(model, opt), meta={...})  # returns after the copy
    ...                                      # training goes on while a thread writes, hashes and commits
    saver.wait()                             # committed (the next save and the end of training wait too)

The copy goes into host buffers kept from one save to the next (pinned when CUDA is there), by torch's
`DefaultStager`. A thread then does what `save` does after that copy (`save.write`): the rank files, their
SHA-256, rank 0's index and rename, and the atomic `latest`, so a kill mid-save leaves the previous checkpoint
as `latest`. Its collectives run on a gloo group of their own, created by the first save, so they never
interleave with the training's. A failed save raises on every rank: from `wait()`, from the next `save()`,
and (`failed()`) from the trainer's next step.
State in memory-mapped files (offload="nvme:DIR", possibly larger than host memory) is not copied to host
buffers: such a save is written synchronously from the files (`save`), piece by piece.
A save in flight when the script ends is finished in order, so that a script may end right after `save()`:
`torch.distributed.destroy_process_group()` (wrapped by spmd.runtime.dtensor.teardown, which the first
AsyncSaver installs) first waits for every save in flight (whose collectives run on a
group it would destroy), and so does the interpreter's exit (an atexit handler; a writer still running in
native code as the interpreter finalizes aborts the process, "terminate called without an active exception").
A save that fails there raises from `destroy_process_group` after the groups are gone, or, at exit, is
printed and the process exits 1: a lost checkpoint never ends a job with 0.
Choice: this thread over DCP's `async_save` with `HuggingFaceStorageWriter`, which would replace the rank
files, the per-file SHA-256 index, the atomic `latest` and the interrupted-save points rather than keep them.
"""

import os
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..runtime import dtensor
from ..runtime.dtensor.teardown import before_destroy
from ..runtime.optimizer.offload import file_backed
from .common import all_gather
from .save import Job, prepare, save, write

__all__ = ["AsyncSaver", "finish_saves"]

_IN_FLIGHT: set = set()  # savers whose writer may still run, until someone waits for it
_SAVERS: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()  # each holds a gloo group of its own


class AsyncSaver:
    """Saves like `spmd.checkpoint.save`, with the writing in a background thread; one save in flight at a time."""

    def __init__(self):
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
            )
        )
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: Path | None = None
        _SAVERS.add(self)
        before_destroy(finish_saves, _let_go_of_groups, "spmd.checkpoint")
        dtensor.install()  # destroy_process_group and the interpreter's exit wait for the saves in flight

    def save(
        self,
        ckpt_dir: str | os.PathLike,
        step: int,
        model_state: dict[str, torch.Tensor],
        optim_state: dict[str, torch.Tensor] | None = None,
        meta: dict | None = None,
        keep: int | None = None,
    ) -> Path:
        """Collective, arguments as `save`'s. Waits for the previous save (raising its error), copies this rank's
        shards to host buffers, starts the writer and returns the directory the checkpoint will be committed to."""
        self.wait()
        mapped = any(file_backed(t) for t in (*model_state.values(), *(optim_state or {}).values()))
        if any(all_gather(mapped)):  # every rank takes the same path: the two use different groups
            return save(ckpt_dir, step, model_state, optim_state, meta, keep)
        job = prepare(ckpt_dir, step, model_state, optim_state, meta, keep, stage=self._stager.stage)
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # collective: every rank is here, in the same order
        self._pending = job.final
        self._thread = threading.Thread(
            target=self._write, args=(job,), name=f"spmd-checkpoint-{job.step}", daemon=True
        )
        _IN_FLIGHT.add(self)
        self._thread.start()
        return job.final

    def _write(self, job: Job) -> None:
        try:
            write(job, self._group)
        except BaseException as e:  # noqa: BLE001  (kept for the caller's thread: wait() raises it)
            self._error = e

    def failed(self) -> bool:
        """Whether the save in flight has ended in an error (without waiting for it)."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    def wait(self) -> Path | None:
        """Blocks until the save in flight is committed and returns its directory (None when there was none);
        raises its error, naming the step, on the caller's thread."""
        if self._thread is None:
            return None
        self._thread.join()
        _IN_FLIGHT.discard(self)
        error, done = self._error, self._pending
        self._thread = self._error = self._pending = None
        if error is not None:
            raise RuntimeError(f"background checkpoint save to {done} failed: {error}") from error
        return done

    def close(self) -> None:
        """Waits for the save in flight, then frees the host buffers."""
        try:
            self.wait()
        finally:
            self._stager.close()


def finish_saves() -> list[BaseException]:
    """Waits for every save in flight in this process and returns their errors (none raised here)."""
    errors = []
    for saver in list(_IN_FLIGHT):
        try:
            saver.wait()
        except Exception as e:  # noqa: BLE001  (each caller decides how to report them)
            errors.append(e)
    return errors


def _let_go_of_groups() -> None:
    """Drops each saver's group (destroyed with the world, or about to be at exit), so that its gloo workers are
    joined when the groups go rather than in the interpreter's finalization (spmd.layout.mesh.release_groups)."""
    for saver in list(_SAVERS):
        saver._group = None
