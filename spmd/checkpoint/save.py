"""Writing a checkpoint: every rank its own shards, one writer per slice, committed atomically.

`save` = `prepare` (collective on the default group: who writes what, this rank's boxes copied to the host)
then `write` (files, checksums, commit: collective over the group it is given, so it can run in a thread).
Every file goes through `_write_rank_file` or `_write_json`.
"""

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.optimizer.offload import file_backed, release_pages
from .common import (
    FORMAT,
    LATEST,
    RNG_CPU,
    RNG_CUDA,
    all_gather,
    barrier,
    dtype_name,
    fsync_dir,
    rank_file,
    rank_world,
    region,
)
from .stream import save_file
from .verify import file_record

__all__ = ["Job", "save", "prepare", "write"]


@dataclass
class Job:
    """One save, taken at the moment of the call: what this rank writes (on the host) and the global index."""

    ckpt_dir: Path
    step: int
    rank: int
    world: int
    out: dict[str, torch.Tensor]  # the boxes this rank writes and its RNG states, as host tensors
    index: dict
    meta_json: str
    keep: int | None

    @property
    def tmp(self) -> Path:
        return self.ckpt_dir / f".tmp-step-{self.step}"

    @property
    def final(self) -> Path:
        return self.ckpt_dir / f"step-{self.step}"


def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, torch.Tensor] | None = None,
    meta: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Collective (every rank calls it): writes `ckpt_dir/step-<step>` atomically and points `latest` at it.

    `model_state` / `optim_state` map names to plain tensors or DTensors (any mesh, Shard/Replicate
    placements). A plain tensor is taken to be the whole tensor; if several ranks hold it, the lowest writes.
    `meta` must be JSON-serialisable. `keep` (if set) deletes all but the newest `keep` checkpoints.
    Returns the committed directory. (`AsyncSaver.save` does the writing in the background.)
    """
    return write(prepare(ckpt_dir, step, model_state, optim_state, meta, keep, stage=_host_copy))


def prepare(
    ckpt_dir, step: int, model_state: dict, optim_state: dict | None, meta: dict | None, keep: int | None, stage
) -> Job:
    """Collective: checks the state, agrees on who writes each box (the lowest rank proposing it), and copies
    this rank's boxes off the device with `stage` (a dict of tensors to a dict of host tensors)."""
    rank, world = rank_world()
    tensors: dict[str, torch.Tensor] = {}
    for prefix, state in (("model.", model_state), ("optim.", optim_state or {})):
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"checkpoint state {prefix}{name} is a {type(t).__name__}, not a tensor; "
                    "put non-tensor values into meta"
                )
            tensors[prefix + name] = t
    try:
        meta_json = json.dumps(meta or {}, indent=1, sort_keys=True)
    except TypeError as e:
        raise TypeError(
            f"checkpoint meta must be JSON-serialisable ({e}); convert it to plain dicts/lists/numbers/strings"
        ) from None
    proposals, locals_, index, writer = _assign_writers(tensors)
    mine = {
        key: local.detach()
        for key, local in locals_.items()
        if writer.get((key, tuple(proposals[key][2]), tuple(proposals[key][3]))) == rank
    }
    out = dict(stage(mine))
    release_pages(locals_.values())  # file-backed (nvme-offloaded) state: staged, its pages go back to the file
    out[RNG_CPU] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[RNG_CUDA] = torch.cuda.get_rng_state()
    return Job(Path(ckpt_dir), int(step), rank, world, out, index, meta_json, keep)


def write(job: Job, group=None) -> Path:
    """Collective over `group`: every rank writes its file into the temporary directory, rank 0 commits (meta,
    index with every file's checksum, rename, pointer). An error on any rank raises on every rank."""
    files = _write_rank_files(job, group)
    error = None
    if job.rank == 0:
        try:
            _commit(job, files)
        except Exception as e:  # report instead of leaving the other ranks waiting
            error = f"rank 0: {type(e).__name__}: {e}"
    errors = [e for e in all_gather(error, group) if e]  # nobody returns before the checkpoint is committed
    if errors:
        raise RuntimeError(
            f"checkpoint save of step {job.step}: committing {job.tmp} failed: {errors[0]}. "
            "The previous checkpoint is untouched."
        )
    return job.final


def _host_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies to write from; a file-backed (nvme-offloaded) tensor is written from its file, uncopied:
    nothing changes it before the synchronous write, which reads it piece by piece (spmd.checkpoint.stream)."""
    return {
        k: x.to("cpu") if x.device.type != "cpu" else x if file_backed(x) else x.clone() for k, x in tensors.items()
    }


def _writable(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors sharing no storage, as safetensors writes them."""
    seen, ready = set(), {}
    for key, x in out.items():
        ptr = x.untyped_storage().data_ptr()
        ready[key] = (
            x.contiguous() if x.is_contiguous() and ptr not in seen else x.clone(memory_format=torch.contiguous_format)
        )
        seen.add(ptr)
    return ready


def _assign_writers(tensors: dict) -> tuple[dict, dict, dict, dict]:
    """(proposals, local tensors, index, writer): each rank's (shape, dtype, box) per tensor, the global index
    of shards, and which rank writes each box (the lowest that holds it)."""
    proposals, locals_ = {}, {}
    for key, t in tensors.items():
        offsets, lengths, local = region(t)
        locals_[key] = local
        proposals[key] = (list(t.shape), dtype_name(t.dtype), offsets, lengths)
    everyone = all_gather(proposals)
    index: dict[str, dict] = {}
    writer: dict[tuple, int] = {}
    for r, props in enumerate(everyone):
        for key, (shape, dtype, offsets, lengths) in props.items():
            entry = index.setdefault(key, {"shape": shape, "dtype": dtype, "shards": []})
            if entry["shape"] != shape or entry["dtype"] != dtype:
                raise ValueError(
                    f"ranks disagree on {key}: global shape/dtype {entry['shape']}/{entry['dtype']} "
                    f"vs {shape}/{dtype} on rank {r}; every rank must pass the same tensors"
                )
            box = (key, tuple(offsets), tuple(lengths))
            if box not in writer and math.prod(lengths) > 0:
                writer[box] = r
                entry["shards"].append({"file": rank_file(r), "offsets": offsets, "lengths": lengths})
    for key, entry in index.items():
        covered = sum(math.prod(s["lengths"]) for s in entry["shards"])
        if covered != math.prod(entry["shape"]):
            raise ValueError(
                f"the shards of {key} cover {covered} of {math.prod(entry['shape'])} elements; "
                "ranks passed overlapping or incomplete pieces of it"
            )
    return proposals, locals_, index, writer


def _write_rank_files(job: Job, group) -> dict[str, dict]:
    """Collective: every rank writes its boxes (and its RNG state) into `job.tmp`; a failure on any rank raises
    on every rank. Returns every rank file's size and SHA-256."""
    if job.rank == 0:
        job.ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in job.ckpt_dir.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        job.tmp.mkdir()
    barrier(group)
    error = None
    try:
        path = job.tmp / rank_file(job.rank)
        _write_rank_file(path, _writable(job.out))
        record = {path.name: file_record(path)}  # of the bytes on disk: a short write shows up here already
    except Exception as e:  # report instead of leaving the other ranks waiting at a barrier
        error, record = f"rank {job.rank}: {type(e).__name__}: {e}", {}
    gathered = all_gather((error, record), group)
    errors = [e for e, _ in gathered if e]
    if errors:
        raise RuntimeError(
            f"checkpoint save of step {job.step} to {job.tmp} failed: "
            + "; ".join(errors)
            + ". The previous checkpoint is untouched."
        )
    return {name: rec for _, r in gathered for name, rec in r.items()}


def _write_rank_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt", "spmd": FORMAT})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj: dict, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=sort_keys))


def _commit(job: Job, files: dict) -> None:
    """Rank 0: meta and index (with `files`' and meta's checksums) into `job.tmp`, renamed to `job.final`,
    `latest` pointed at it, old ones pruned."""
    ckpt_dir, tmp, final, step, world = job.ckpt_dir, job.tmp, job.final, job.step, job.world
    _write_json(tmp / "meta.json", {**json.loads(job.meta_json), "step": step, "world_size": world}, sort_keys=True)
    files = {**files, "meta.json": file_record(tmp / "meta.json")}
    _write_json(
        tmp / "index.json", {"format": FORMAT, "step": step, "world_size": world, "files": files, "tensors": job.index}
    )
    fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        old = ckpt_dir / f".tmp-old-step-{step}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    pointer = ckpt_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, ckpt_dir / LATEST)
    fsync_dir(ckpt_dir)
    if job.keep:
        steps = sorted((int(p.name[5:]), p) for p in ckpt_dir.glob("step-*") if p.name[5:].isdigit())
        for _s, p in steps[: -job.keep]:
            if p != final:
                shutil.rmtree(p, ignore_errors=True)
