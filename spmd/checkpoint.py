"""Sharded safetensors checkpoints that load onto any mesh. No pickle touches the disk.

A checkpoint is a directory `<ckpt_dir>/step-N/`:

    rank-00000.safetensors ...   each rank's LOCAL shards (one writer per distinct slice; replicas skip)
                                 plus that rank's RNG states under `__rng__.cpu` / `__rng__.cuda`
    index.json                   every tensor's global shape and dtype, and per file the slice it holds
                                 (`offsets` and `lengths` per dim)
    meta.json                    step, world size and whatever the caller passes (config, data position)

Tensor names are `model.<parameter name>` and `optim.<parameter name>.<state key>` (AdamW: `exp_avg`,
`exp_avg_sq`, `step`). Loading builds each local shard of the *target* layout from the slices of the files
that overlap it (`safe_open(...).get_slice`), so a checkpoint written on `fsdp=4` loads on `fsdp=2,tp=2`
or into plain tensors in one process.

Atomic commit: every rank writes into `<ckpt_dir>/.tmp-step-N`; once all ranks report success, rank 0
writes the index, renames the directory to `step-N`, and replaces the `latest` pointer file with
`os.replace`. A process killed mid-save leaves only a `.tmp-*` directory behind (cleared by the next save);
`latest` keeps pointing at the previous complete checkpoint.

    save(ckpt_dir, step, model_state(model), optim_state(model, opt), meta={...})
    meta = load(ckpt_dir, model_state(model), optim_state(model, opt, init=True))
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

FORMAT = "spmd-safetensors/1"
LATEST = "latest"
_RNG_CPU, _RNG_CUDA = "__rng__.cpu", "__rng__.cuda"

__all__ = ["save", "load", "resolve", "latest", "model_state", "optim_state", "read_full", "read_into",
           "tensor_names", "read_meta"]


# ----------------------------------------------------------------------------------------------- state dicts
def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once, under their first name) and persistent buffers, by name."""
    state = dict(model.named_parameters())
    seen = {id(p) for p in state.values()}
    non_persistent = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{mod_name}.{b}" if mod_name else b)
    for name, buf in model.named_buffers():
        if name not in non_persistent and id(buf) not in seen:
            state[name] = buf
    return state


def optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, init: bool = False
                ) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state flattened to `<param name>.<key>` (AdamW: exp_avg, exp_avg_sq, step).

    The tensors are the optimizer's own (loading fills them in place). AdamW creates its state lazily on the
    first step; `init=True` creates it now, exactly as AdamW would, so a checkpoint can be loaded into it.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("optimizer holds a parameter that is not in the model; "
                                 "pass the model the optimizer was built from")
            state = optimizer.state[p]
            if not state and init:
                if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                    raise ValueError(f"optim_state(init=True) knows how to create Adam/AdamW state only, "
                                     f"not {type(optimizer).__name__}; take one optimizer step first")
                on_device = group.get("capturable") or group.get("fused")
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    value = state[key] = torch.tensor(float(value), dtype=torch.float32)
                out[f"{names[id(p)]}.{key}"] = value
    return out


# ----------------------------------------------------------------------------------------------- layout helpers
def _region(t: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """(global offsets, lengths, local tensor) of the box of the global tensor this rank holds."""
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            raise ValueError(f"cannot checkpoint a DTensor with a Partial placement {t.placements}; "
                             "redistribute it to Replicate or Shard first")
        lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(lengths):
            raise ValueError(f"local shard shape {tuple(local.shape)} does not match the box {tuple(lengths)} "
                             f"its placements {t.placements} imply (strided shardings are not supported)")
        return list(offsets), list(lengths), local
    return [0] * t.dim(), list(t.shape), t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)  # pickles over the wire only; nothing pickled reaches the disk
        return out
    return [obj]


def _barrier():
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# ----------------------------------------------------------------------------------------------- save
def save(ckpt_dir: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
         optim_state: dict[str, torch.Tensor] | None = None, meta: dict | None = None,
         keep: int | None = None) -> Path:
    """Collective (every rank calls it): writes `ckpt_dir/step-<step>` atomically and points `latest` at it.

    `model_state` / `optim_state` map names to plain tensors or DTensors (any mesh, Shard/Replicate
    placements). A plain tensor is taken to be the whole tensor; if several ranks hold it, the lowest writes.
    `meta` must be JSON-serialisable. `keep` (if set) deletes all but the newest `keep` checkpoints.
    Returns the committed directory.
    """
    rank, world = _rank_world()
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
    proposals, locals_ = {}, {}
    for key, t in tensors.items():
        offsets, lengths, local = _region(t)
        locals_[key] = local
        proposals[key] = (list(t.shape), _dtype_name(t.dtype), offsets, lengths)
    everyone = _all_gather(proposals)
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
                entry["shards"].append({"file": _rank_file(r), "offsets": offsets, "lengths": lengths})
    for key, entry in index.items():
        covered = sum(math.prod(s["lengths"]) for s in entry["shards"])
        if covered != math.prod(entry["shape"]):
            raise ValueError(f"the shards of {key} cover {covered} of {math.prod(entry['shape'])} elements; "
                             "ranks passed overlapping or incomplete pieces of it")

    # 2. Every rank writes its file into the temporary directory.
    tmp = ckpt_dir / f".tmp-step-{step}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    error = None
    try:
        out: dict[str, torch.Tensor] = {}
        for key, local in locals_.items():
            offsets, lengths = proposals[key][2], proposals[key][3]
            if writer.get((key, tuple(offsets), tuple(lengths))) == rank:
                x = local.detach()
                x = x.to("cpu") if x.device.type != "cpu" else x.clone()
                out[key] = x.contiguous()
        out[_RNG_CPU] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[_RNG_CUDA] = torch.cuda.get_rng_state()
        path = tmp / _rank_file(rank)
        save_file(out, str(path), metadata={"format": "pt", "spmd": FORMAT})
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    except Exception as e:  # report instead of leaving the other ranks waiting at a barrier
        error = f"rank {rank}: {type(e).__name__}: {e}"
    errors = [e for e in _all_gather(error) if e]
    if errors:
        raise RuntimeError(f"checkpoint save of step {step} to {tmp} failed: " + "; ".join(errors)
                           + ". The previous checkpoint is untouched.")

    # 3. Rank 0 commits: index + meta, rename, pointer.
    final = ckpt_dir / f"step-{step}"
    if rank == 0:
        (tmp / "index.json").write_text(json.dumps(
            {"format": FORMAT, "step": step, "world_size": world, "tensors": index}, indent=1))
        (tmp / "meta.json").write_text(json.dumps({**json.loads(meta_json), "step": step, "world_size": world},
                                                  indent=1, sort_keys=True))
        _fsync_dir(tmp)
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
        _fsync_dir(ckpt_dir)
        if keep:
            steps = sorted((int(p.name[5:]), p) for p in ckpt_dir.glob("step-*") if p.name[5:].isdigit())
            for s, p in steps[:-keep]:
                if p != final:
                    shutil.rmtree(p, ignore_errors=True)
    _barrier()  # nobody returns before the checkpoint is committed
    return final


# ----------------------------------------------------------------------------------------------- load
def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `ckpt_dir/latest` points at, or None when there is none yet."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    target = Path(ckpt_dir) / pointer.read_text().strip()
    if not (target / "index.json").is_file():
        raise FileNotFoundError(f"{pointer} points at {target}, which is not a complete checkpoint; "
                                f"edit {pointer} to name an existing step-N directory")
    return target


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory (`step-N`, holding index.json) or a ckpt_dir with a `latest` pointer."""
    path = Path(path)
    if (path / "index.json").is_file():
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {path}: it has neither index.json nor a '{LATEST}' pointer; "
                                "pass a directory written by spmd.checkpoint.save (or its step-N subdirectory)")
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
            path = self.root / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing; the checkpoint is incomplete")
            self.handles[name] = safe_open(str(path), framework="pt")
        return self.handles[name]


def read_into(target: torch.Tensor, key: str, shards: list[dict], files, global_shape=None,
              name: str | None = None) -> None:
    """Fill `target`'s local box (plain tensor: all of it) from the `shards` of tensor `key`.

    `shards`: [{"file", "offsets", "lengths"}]; `files(file)` returns an open `safe_open` handle. Only the
    overlapping slices are read. Converts dtype and device as needed.
    """
    name = name or key
    if global_shape is not None and list(target.shape) != list(global_shape):
        raise ValueError(f"{name}: checkpoint holds global shape {list(global_shape)} but the target is "
                         f"{list(target.shape)}; build the model with the same config the checkpoint was written with")
    offsets, lengths, local = _region(target)
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
        if local.dim() == 0 or (lo == list(shard["offsets"]) and
                                [h - l for l, h in zip(lo, hi)] == list(shard["lengths"])):
            piece = f.get_tensor(key)
        else:
            piece = f.get_slice(key)[tuple(slice(l - so, h - so) for l, h, so in zip(lo, hi, shard["offsets"]))]
        if lo == offsets and list(piece.shape) == lengths:
            buf = piece
        else:
            if buf is None:
                buf = torch.empty(lengths, dtype=piece.dtype)
            buf[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))] = piece
        covered += piece.numel()
    if covered != math.prod(lengths):
        raise ValueError(f"{name}: the checkpoint's shards cover {covered} of the {math.prod(lengths)} elements "
                         "this rank needs; the checkpoint is incomplete")
    with torch.no_grad():
        local.copy_(buf.reshape(local.shape))


def load(path: str | os.PathLike, model_state: dict[str, torch.Tensor] | None = None,
         optim_state: dict[str, torch.Tensor] | None = None, strict: bool = True, rng: bool = False) -> dict:
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
            read_into(t, key, entry["shards"], files, entry["shape"])
        unexpected += [k for k in index if k.startswith(prefix) and k[len(prefix):] not in state]
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint {step_dir} does not match the model: missing {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                       f"{' ...' if len(unexpected) > 8 else ''}; load with the model config it was saved with "
                       "(or strict=False to skip them)")
    if rng:
        rank, _ = _rank_world()
        name = _rank_file(rank) if (step_dir / _rank_file(rank)).is_file() else _rank_file(0)
        f = files(name)
        torch.set_rng_state(f.get_tensor(_RNG_CPU))
        if _RNG_CUDA in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor(_RNG_CUDA))
    return json.loads((step_dir / "meta.json").read_text())


def read_full(path: str | os.PathLike, key: str) -> torch.Tensor:
    """One whole tensor (e.g. `model.norm.weight`) assembled from every file's slice."""
    step_dir = resolve(path)
    index = _index(step_dir)["tensors"]
    if key not in index:
        raise KeyError(f"{key} is not in checkpoint {step_dir}; it holds {sorted(index)[:8]} ...")
    entry = index[key]
    out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
    read_into(out, key, entry["shards"], _Files(step_dir), entry["shape"])
    return out
