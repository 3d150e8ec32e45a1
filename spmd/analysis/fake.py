"""Fake worlds: a process group of any size in this one process, whose collectives move nothing, and
tensors that hold no data. `explain` runs the real pass inside one.

Inside `kept_worlds()` (the search's dry runs) a world outlives its dry run: the next dry run of as many
ranks finds its process group and, for the same sizes, its mesh, and with them DTensor's cached sharding and
redistribution plans (a third of a dry run's time when recomputed, and on a mesh of three axes seconds more);
the meshes of one world size live side by side on its group, so a search that goes from mesh to mesh and back
keeps every mesh's plans. A world of another size replaces it, and leaving the scope destroys the last one.

Inside a fake world DTensor plans every redistribution afresh (under a FakeTensorMode it takes itself to be
tracing and skips its cache of transform plans): spmd.runtime.dtensor.planning keeps them, as it keeps the
prices of every op's strategies, for dry runs and real runs alike."""

import contextlib
import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from ..layout.mesh import make_mesh
from ..runtime.dtensor.planning import memo

__all__ = ["fake_world", "kept_worlds"]

_kept = {"depth": 0, "world": None}  # world: (ranks, the default group it made, {sizes as a tuple: mesh})


@contextlib.contextmanager
def kept_worlds():
    """Within this scope a fake world stays up after its dry run, for the next one of as many ranks."""
    _kept["depth"] += 1
    try:
        yield
    finally:
        _kept["depth"] -= 1
        if not _kept["depth"] and _kept["world"] is not None:
            _kept["world"] = None
            if dist.is_initialized():
                dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(sizes: dict):
    """(mesh of `sizes` on a fake process group, FakeTensorMode): everything a dry run needs. The fake group
    replaces any process group this process has and is destroyed on exit (inside `kept_worlds`, when a world
    of another size or the scope's end replaces it)."""
    key, ranks = tuple(sizes.items()), math.prod(sizes.values())
    kept = _kept["world"]
    if kept is not None and kept[0] == ranks and dist.is_initialized() and dist.group.WORLD is kept[1]:
        if key not in kept[2]:
            kept[2][key] = make_mesh(sizes, device_type="cpu")
        mesh = kept[2][key]
    else:
        mesh = _new_world(sizes)
        _kept["world"] = (ranks, dist.group.WORLD, {key: mesh}) if _kept["depth"] else None
    try:
        # Fake CPU tensors rather than meta: ops such as attention pick their kernel by device.
        with _real_strided_offsets():
            yield mesh, FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        if _kept["world"] is None:
            dist.destroy_process_group()


def _new_world(sizes: dict):
    """A fake default process group of the mesh's size, in place of any this process has, and its mesh."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=math.prod(sizes.values()))
    _clear_dtensor_caches()
    return make_mesh(sizes, device_type="cpu")


_strided_offsets: dict = {}  # (placement, local size, chunks, rank, mode) -> (size, offsets): ints only


@contextlib.contextmanager
def _real_strided_offsets():
    """A linear layer on an activation split over two mesh axes on two dims (batch over fsdp, sequence over
    cp) flattens them into one _StridedShard dim, whose offsets torch computes from an index tensor and
    `.tolist()`: data-dependent under a FakeTensorMode. The indices hold no data of the model; they are
    computed as real tensors here, once per arguments (plain ints)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.local_shard_size_and_offset

    def real(*args, **kwargs):
        def compute():
            with unset_fake_temporarily():
                return original(*args, **kwargs)

        # an argument that is not a plain int has no key: memo computes it unkept
        size, offsets = memo(_strided_offsets, (args, tuple(sorted(kwargs.items()))), compute)
        return size, list(offsets) if isinstance(offsets, list) else offsets

    _StridedShard.local_shard_size_and_offset = real
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def _clear_dtensor_caches():
    """DTensor caches sharding and redistribution plans by spec, and meshes compare equal by layout, not by
    process group: a plan cached in an earlier fake world would carry that world's groups into this one."""
    from torch.distributed.tensor import _redistribute

    for clear in (
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
    ):  # the C++ fast path's
        if clear is not None:
            clear()
