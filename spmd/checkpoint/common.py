"""What saving and loading share: the format name, file names, the box of a tensor a rank holds, and
process-group helpers that also work without a process group."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = [
    "FORMAT",
    "LATEST",
    "RNG_CPU",
    "RNG_CUDA",
    "all_gather",
    "barrier",
    "dtype_name",
    "fsync_dir",
    "rank_file",
    "rank_world",
    "region",
]

FORMAT = "spmd-safetensors/1"
LATEST = "latest"
RNG_CPU, RNG_CUDA = "__rng__.cpu", "__rng__.cuda"


def region(t: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """(global offsets, lengths, local tensor) of the box of the global tensor this rank holds."""
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            raise ValueError(
                f"cannot checkpoint a DTensor with a Partial placement {t.placements}; "
                "redistribute it to Replicate or Shard first"
            )
        lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(lengths):
            raise ValueError(
                f"local shard shape {tuple(local.shape)} does not match the box {tuple(lengths)} "
                f"its placements {t.placements} imply (strided shardings are not supported)"
            )
        return list(offsets), list(lengths), local
    return [0] * t.dim(), list(t.shape), t


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(obj, group=None):
    """Every rank's `obj`, over `group` (default: the default group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)  # pickles over the wire only; nothing pickled reaches the disk
        return out
    return [obj]


def barrier(group=None):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def fsync_dir(path: Path):
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


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"
