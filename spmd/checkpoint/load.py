"""Reading a checkpoint onto any layout: each rank reads only the slices its tensors hold."""

import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..runtime.optimizer.offload import release_pages
from .common import FORMAT, LATEST, RNG_CPU, RNG_CUDA, rank_file, rank_world, region

__all__ = ["latest", "load", "outside_problem", "read_full", "read_into", "read_meta", "resolve", "tensor_names"]


def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `ckpt_dir/latest` points at, or None when there is none yet."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    target = Path(ckpt_dir) / pointer.read_text().strip()
    if not (target / "index.json").is_file():
        raise FileNotFoundError(
            f"{pointer} points at {target}, which is not a complete checkpoint; "
            f"edit {pointer} to name an existing step-N directory"
        )
    return target


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory (`step-N`, holding index.json) or a ckpt_dir with a `latest` pointer."""
    path = Path(path)
    if (path / "index.json").is_file():
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint at {path}: it has neither index.json nor a '{LATEST}' pointer; "
            "pass a directory written by spmd.checkpoint.save (or its step-N subdirectory)"
        )
    return found


def _index(step_dir: Path) -> dict:
    index = json.loads((step_dir / "index.json").read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{step_dir}/index.json has format {index.get('format')!r}, expected {FORMAT!r}")
    return index


def read_meta(path: str | os.PathLike) -> dict:
    """meta.json of a checkpoint (step, world_size and what the saver passed)."""
    return json.loads((resolve(path) / "meta.json").read_text())


def tensor_names(path: str | os.PathLike) -> dict[str, dict]:
    """name -> {"shape", "dtype", "shards"} for every tensor in a checkpoint."""
    return _index(resolve(path))["tensors"]


class _Files:
    """Opens each safetensors file at most once per load."""

    def __init__(self, root: Path):
        self.root, self.handles = root, {}

    def __call__(self, name: str):
        if name not in self.handles:
            problem = outside_problem(name)
            if problem:
                raise ValueError(f"{self.root}/index.json: {problem}")
            path = self.root / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing; the checkpoint is incomplete")
            self.handles[name] = safe_open(str(path), framework="pt")
        return self.handles[name]


def read_into(
    target: torch.Tensor,
    key: str,
    shards: list[dict],
    files,
    global_shape=None,
    name: str | None = None,
    dtype: str | None = None,
) -> None:
    """Fill `target`'s local box (plain tensor: all of it) from the `shards` of tensor `key`.

    `shards`: [{"file", "offsets", "lengths"}]; `files(file)` returns an open `safe_open` handle. Only the
    overlapping slices are read. Converts dtype and device as needed. Each shard must hold the shape its
    entry names (and `dtype`, when given, the index's dtype): a file that disagrees with its index is damaged.
    """
    name = name or key
    if global_shape is not None and list(target.shape) != list(global_shape):
        raise ValueError(
            f"{name}: checkpoint holds global shape {list(global_shape)} but the target is "
            f"{list(target.shape)}; build the model with the same config the checkpoint was written with"
        )
    offsets, lengths, local = region(target)
    if math.prod(lengths) == 0:
        return
    buf = None
    covered = 0
    for shard in shards:
        lo = [max(a, b) for a, b in zip(offsets, shard["offsets"])]
        hi = [min(a + la, b + lb) for a, la, b, lb in zip(offsets, lengths, shard["offsets"], shard["lengths"])]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        f = files(shard["file"])
        _check_stored(f, key, shard, name)
        if local.dim() == 0 or (
            lo == list(shard["offsets"]) and [h - l for l, h in zip(lo, hi)] == list(shard["lengths"])
        ):
            piece = f.get_tensor(key)
        else:
            piece = f.get_slice(key)[tuple(slice(l - so, h - so) for l, h, so in zip(lo, hi, shard["offsets"]))]
        if dtype is not None and piece.dtype != getattr(torch, dtype):
            raise ValueError(
                f"{name}: {shard['file']} holds {piece.dtype} where the index says {dtype}; "
                "the checkpoint is damaged: resume from an earlier one"
            )
        if lo == offsets and list(piece.shape) == lengths:
            buf = piece
        else:
            if buf is None:
                buf = torch.empty(lengths, dtype=piece.dtype)
            buf[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))] = piece
        covered += piece.numel()
    if covered != math.prod(lengths):
        raise ValueError(
            f"{name}: the checkpoint's shards cover {covered} of the {math.prod(lengths)} elements "
            "this rank needs; the checkpoint is incomplete"
        )
    with torch.no_grad():
        local.copy_(buf.reshape(local.shape))


def outside_problem(name: str) -> str | None:
    """Why a file name from an index would reach outside its checkpoint directory (None: a plain name)."""
    if not name or Path(name).name != name or name in (".", "..") or "\\" in name:
        return f"names file {name!r}, which is not a file inside the checkpoint directory (damaged or edited index)"
    return None


def _check_stored(f, key: str, shard: dict, name: str) -> None:
    try:
        stored = list(f.get_slice(key).get_shape())
    except Exception as e:  # safetensors raises its own error type for a missing key
        raise ValueError(
            f"{name}: {shard['file']} has no tensor {key!r} ({type(e).__name__}); the checkpoint "
            "is damaged: resume from an earlier one"
        ) from None
    if stored != list(shard["lengths"]):
        raise ValueError(
            f"{name}: {shard['file']} holds shape {stored} where the index says "
            f"{list(shard['lengths'])}; the checkpoint is damaged: resume from an earlier one"
        )


def load(
    path: str | os.PathLike,
    model_state: dict[str, torch.Tensor] | None = None,
    optim_state: dict[str, torch.Tensor] | None = None,
    strict: bool = True,
    rng: bool = False,
) -> dict:
    """Fill the given tensors (plain or DTensor, any layout) in place from a checkpoint; return its meta.

    `path`: a `step-N` directory or a ckpt_dir with a `latest` pointer. With `strict`, every given tensor
    must be in the checkpoint and every checkpoint tensor of a given kind (model / optim) must be given.
    `rng=True` restores this rank's torch RNG states (rank 0's when the checkpoint had fewer ranks).
    Needs no collectives: every rank reads what it needs on its own.
    """
    step_dir = resolve(path)
    index = _index(step_dir)["tensors"]
    files = _Files(step_dir)
    missing, unexpected = [], []
    for prefix, state in (("model.", model_state), ("optim.", optim_state)):
        if state is None:
            continue
        for name, t in state.items():
            key = prefix + name
            if key not in index:
                missing.append(key)
                continue
            entry = index[key]
            read_into(t, key, entry["shards"], files, entry["shape"], dtype=entry["dtype"])
            release_pages([t])  # a file-backed (nvme-offloaded) tensor: its values are in its file now
        unexpected += [k for k in index if k.startswith(prefix) and k[len(prefix) :] not in state]
    if strict and (missing or unexpected):
        raise KeyError(
            f"checkpoint {step_dir} does not match the model: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; load with the model config it was saved with "
            "(or strict=False to skip them)"
        )
    if rng:
        rank, _ = rank_world()
        name = rank_file(rank) if (step_dir / rank_file(rank)).is_file() else rank_file(0)
        f = files(name)
        torch.set_rng_state(f.get_tensor(RNG_CPU))
        if RNG_CUDA in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor(RNG_CUDA))
    return json.loads((step_dir / "meta.json").read_text())


def read_full(path: str | os.PathLike, key: str) -> torch.Tensor:
    """One whole tensor (e.g. `model.norm.weight`) assembled from every file's slice."""
    step_dir = resolve(path)
    index = _index(step_dir)["tensors"]
    if key not in index:
        raise KeyError(f"{key} is not in checkpoint {step_dir}; it holds {sorted(index)[:8]} ...")
    entry = index[key]
    out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
    read_into(out, key, entry["shards"], _Files(step_dir), entry["shape"], dtype=entry["dtype"])
    return out
