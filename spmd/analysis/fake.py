"""Fake worlds: a process group of any size in this one process, whose collectives move nothing, and
tensors that hold no data. `explain` runs the real pass inside one.

Inside `kept_worlds()` (the search's dry runs) a world outlives its dry run: the next dry run of the same
sizes finds its process group and mesh, and with them DTensor's cached sharding and redistribution plans
(a third of a dry run's time when recomputed); a world of other sizes replaces it, and leaving the scope
destroys the last one.

Inside a fake world DTensor plans every redistribution afresh: under a FakeTensorMode it takes itself to be
tracing and skips its cache of transform plans, and on a mesh of two or more axes that shard one tensor
dimension (batch over fsdp and sequence over cp, or tp with sequence parallelism) each plan is a
shortest-path search, priced again for every candidate strategy of every op: two thirds of a dry run on
such a mesh. A plan depends only on the two specs (mesh layout, placements, shard order, shape, stride,
dtype: concrete here), so dry runs keep them (`_kept_transform_plans`)."""

import contextlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from ..layout.mesh import make_mesh

__all__ = ["fake_world", "kept_worlds"]

_kept = {"depth": 0, "world": None}  # world: (sizes as a tuple, the default group it made, its mesh)


@contextlib.contextmanager
def kept_worlds():
    """Within this scope a fake world stays up after its dry run, for the next one of the same sizes."""
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
    of other sizes or the scope's end replaces it)."""
    key = tuple(sizes.items())
    kept = _kept["world"]
    if kept is not None and kept[0] == key and dist.is_initialized() and dist.group.WORLD is kept[1]:
        mesh = kept[2]
    else:
        mesh = _new_world(sizes)
        _kept["world"] = (key, dist.group.WORLD, mesh) if _kept["depth"] else None
    try:
        # Fake CPU tensors rather than meta: ops such as attention pick their kernel by device.
        with _real_strided_offsets(), _kept_transform_plans():
            yield mesh, FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        if _kept["world"] is None:
            dist.destroy_process_group()


def _new_world(sizes: dict):
    """A fake default process group of the mesh's size, in place of any this process has, and its mesh."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    world = 1
    for s in sizes.values():
        world *= s
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    _clear_dtensor_caches()
    return make_mesh(sizes, device_type="cpu")


@contextlib.contextmanager
def _real_strided_offsets():
    """A linear layer on an activation split over two mesh axes on two dims (batch over fsdp, sequence over
    cp) flattens them into one _StridedShard dim, whose offsets torch computes from an index tensor and
    `.tolist()`: data-dependent under a FakeTensorMode. The indices hold no data of the model; they are
    computed as real tensors here."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.local_shard_size_and_offset

    def real(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _StridedShard.local_shard_size_and_offset = real
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


_transform_plans: dict = {}  # (src spec, dst spec, graph-based or not, torch's override) -> transform plan
_MAX_TRANSFORM_PLANS = 200_000


@contextlib.contextmanager
def _kept_transform_plans():
    """DTensor's transform planner (`_gen_transform_infos_non_cached`, which it calls uncached under a fake
    mode) answered from `_transform_plans`. Its plans are data (mesh dims, placements, shapes), no group."""
    from torch.distributed.tensor import _redistribute

    original = _redistribute._gen_transform_infos_non_cached

    def kept(src_spec, dst_spec, use_graph_based_transform=None):
        key = (src_spec, dst_spec, use_graph_based_transform, _redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN)
        plan = _transform_plans.get(key)
        if plan is None:
            if len(_transform_plans) > _MAX_TRANSFORM_PLANS:
                _transform_plans.clear()
            plan = _transform_plans[key] = original(src_spec, dst_spec, use_graph_based_transform)
        return list(plan)

    _redistribute._gen_transform_infos_non_cached = kept
    try:
        yield
    finally:
        _redistribute._gen_transform_infos_non_cached = original


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
