"""Writing a checkpoint: every rank its own shards, one writer per slice, committed atomically.

For the tests of interrupted saves, SPMD_TEST_KILL_AFTER_FILES=N makes a process SIGKILL itself right after
it has written its N-th checkpoint file (counting rank files, meta.json and index.json, in that order, over
the life of the process).
"""
import json
import math
import os
import shutil
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file

from .common import FORMAT, LATEST, RNG_CPU, RNG_CUDA, all_gather, barrier, dtype_name, fsync_dir, rank_file, \
    rank_world, region
from .verify import file_record

__all__ = ["save"]

_files_written = 0


def _written() -> None:
    global _files_written
    _files_written += 1
    if str(_files_written) == os.environ.get("SPMD_TEST_KILL_AFTER_FILES"):
        os.kill(os.getpid(), signal.SIGKILL)


def save(ckpt_dir: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
         optim_state: dict[str, torch.Tensor] | None = None, meta: dict | None = None,
         keep: int | None = None) -> Path:
    """Collective (every rank calls it): writes `ckpt_dir/step-<step>` atomically and points `latest` at it.

    `model_state` / `optim_state` map names to plain tensors or DTensors (any mesh, Shard/Replicate
    placements). A plain tensor is taken to be the whole tensor; if several ranks hold it, the lowest writes.
    `meta` must be JSON-serialisable. `keep` (if set) deletes all but the newest `keep` checkpoints.
    Returns the committed directory.
    """
    rank, world = rank_world()
    ckpt_dir = Path(ckpt_dir)
    step = int(step)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, state in (("model.", model_state), ("optim.", optim_state or {})):
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"checkpoint state {prefix}{name} is a {type(t).__name__}, not a tensor; "
                                "put non-tensor values into meta")
            tensors[prefix + name] = t
    try:
        meta_json = json.dumps(meta or {}, indent=1, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"checkpoint meta must be JSON-serialisable ({e}); convert it to plain "
                        "dicts/lists/numbers/strings") from None

    # 1. Agree on who writes what: the lowest rank proposing a given (name, box) writes it.
    proposals, locals_, index, writer = _assign_writers(tensors)
    # 2. Every rank writes its file into the temporary directory.
    tmp = ckpt_dir / f".tmp-step-{step}"
    files = _write_rank_files(ckpt_dir, tmp, step, rank, locals_, proposals, writer)
    # 3. Rank 0 commits: meta, index (with every file's checksum), rename, pointer.
    final = ckpt_dir / f"step-{step}"
    if rank == 0:
        _commit(ckpt_dir, tmp, final, step, world, index, files, meta_json, keep)
    barrier()  # nobody returns before the checkpoint is committed
    return final


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
                raise ValueError(f"ranks disagree on {key}: global shape/dtype {entry['shape']}/{entry['dtype']} "
                                 f"vs {shape}/{dtype} on rank {r}; every rank must pass the same tensors")
            box = (key, tuple(offsets), tuple(lengths))
            if box not in writer and math.prod(lengths) > 0:
                writer[box] = r
                entry["shards"].append({"file": rank_file(r), "offsets": offsets, "lengths": lengths})
    for key, entry in index.items():
        covered = sum(math.prod(s["lengths"]) for s in entry["shards"])
        if covered != math.prod(entry["shape"]):
            raise ValueError(f"the shards of {key} cover {covered} of {math.prod(entry['shape'])} elements; "
                             "ranks passed overlapping or incomplete pieces of it")
    return proposals, locals_, index, writer


def _write_rank_files(ckpt_dir: Path, tmp: Path, step: int, rank: int, locals_: dict, proposals: dict,
                      writer: dict) -> dict[str, dict]:
    """Collective: every rank writes the boxes it was assigned (and its RNG state) into `tmp`; a failure on
    any rank raises on every rank. Returns every rank file's size and SHA-256."""
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()
    error = None
    try:
        out: dict[str, torch.Tensor] = {}
        for key, local in locals_.items():
            offsets, lengths = proposals[key][2], proposals[key][3]
            if writer.get((key, tuple(offsets), tuple(lengths))) == rank:
                x = local.detach()
                x = x.to("cpu") if x.device.type != "cpu" else x.clone()
                out[key] = x.contiguous()
        out[RNG_CPU] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[RNG_CUDA] = torch.cuda.get_rng_state()
        path = tmp / rank_file(rank)
        save_file(out, str(path), metadata={"format": "pt", "spmd": FORMAT})
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        _written()
        record = {path.name: file_record(path)}  # of the bytes on disk: a short write shows up here already
    except Exception as e:  # report instead of leaving the other ranks waiting at a barrier
        error, record = f"rank {rank}: {type(e).__name__}: {e}", {}
    gathered = all_gather((error, record))
    errors = [e for e, _ in gathered if e]
    if errors:
        raise RuntimeError(f"checkpoint save of step {step} to {tmp} failed: " + "; ".join(errors)
                           + ". The previous checkpoint is untouched.")
    return {name: rec for _, r in gathered for name, rec in r.items()}


def _commit(ckpt_dir: Path, tmp: Path, final: Path, step: int, world: int, index: dict, files: dict,
            meta_json: str, keep: int | None) -> None:
    """Rank 0: meta and index (with `files`' and meta's checksums) into `tmp`, `tmp` renamed to `final`,
    `latest` pointed at it, old ones pruned."""
    (tmp / "meta.json").write_text(json.dumps({**json.loads(meta_json), "step": step, "world_size": world},
                                              indent=1, sort_keys=True))
    _written()
    files = {**files, "meta.json": file_record(tmp / "meta.json")}
    (tmp / "index.json").write_text(json.dumps(
        {"format": FORMAT, "step": step, "world_size": world, "files": files, "tensors": index}, indent=1))
    _written()
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
    if keep:
        steps = sorted((int(p.name[5:]), p) for p in ckpt_dir.glob("step-*") if p.name[5:].isdigit())
        for s, p in steps[:-keep]:
            if p != final:
                shutil.rmtree(p, ignore_errors=True)
