"""Fake worlds: a process group of any size in this one process, whose collectives move nothing, and
tensors that hold no data. `explain` runs the real pass inside one.

Inside `kept_worlds()` (the search's dry runs) a world outlives its dry run: the next dry run of as many
ranks finds its process group and, for the same sizes, its mesh, and with them DTensor's cached sharding and
redistribution plans (a third of a dry run's time when recomputed, and on a mesh of three axes seconds more);
the meshes of one world size live side by side on its group, so a search that goes from mesh to mesh and back
keeps every mesh's plans. A world of another size replaces it, and leaving the scope destroys the last one.

Inside a fake world DTensor plans every redistribution afresh: under a FakeTensorMode it takes itself to be
tracing and skips its cache of transform plans, and on a mesh of two or more axes that shard one tensor
dimension (batch over fsdp and sequence over cp, or tp with sequence parallelism) each plan is a
shortest-path search, priced again for every candidate strategy of every op: two thirds of a dry run on
such a mesh. A plan depends only on the two specs (mesh layout, placements, shard order, shape, stride,
dtype: concrete here), so dry runs keep them, and below them the search's graph and shortest paths
(`_kept_transform_plans`): 8B's first dry run on `cp=2,fsdp=2,tp=2` at 16 x 8192 tokens, 176 -> 18 CPU s."""

import contextlib
import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from ..layout.mesh import make_mesh

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
        with _real_strided_offsets(), _kept_transform_plans():
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

        try:
            size, offsets = _memo(_strided_offsets, (args, tuple(sorted(kwargs.items()))), compute)
        except TypeError:  # an argument that is not a plain int: no key
            size, offsets = compute()
        return size, list(offsets) if isinstance(offsets, list) else offsets

    _StridedShard.local_shard_size_and_offset = real
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


_transform_plans: dict = {}  # (src spec, dst spec, graph-based or not, torch's override) -> transform plan
_prices: dict = {}  # (src spec, dst spec, torch's override) -> an op strategy's price of that move
_graphs: dict = {}  # (mesh, rank, bytes, targets) and a state -> its next states and costs, or its paths
_MAX_TRANSFORM_PLANS = 200_000


@contextlib.contextmanager
def _kept_transform_plans():
    """DTensor's transform planner (`_gen_transform_infos_non_cached`, which it calls uncached under a fake
    mode) answered from `_transform_plans`. Its plans are data (mesh dims, placements, shapes), no group.

    Below a plan, the shortest-path search walks a graph whose states are placements and shard orders and whose
    edge costs depend on the mesh, the tensor's rank and its bytes alone (`one_step_redistribute_cost`), not on
    its shape: its edges and shortest paths are kept per (mesh, rank, bytes, the planner's targets), so tensors
    of one size share them; the plan's shapes along the path are still computed per tensor. A state's moves
    (which states follow it, by which one-axis step) do not depend on the bytes either: they are kept per
    (mesh, rank, targets) and priced per size (`_priced`).

    Above the plans, every op's sharding strategies price each input's move to each candidate layout
    (`redistribute_cost`, a third of a dry run on a mesh of three axes); a price depends on the two specs alone,
    so it is kept too."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._ops import utils as strategies

    original, price = _redistribute._gen_transform_infos_non_cached, strategies.redistribute_cost

    def kept(src_spec, dst_spec, use_graph_based_transform=None):
        key = (src_spec, dst_spec, use_graph_based_transform, _redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN)
        return list(_memo(_transform_plans, key, lambda: original(src_spec, dst_spec, use_graph_based_transform)))

    def kept_price(src_spec, dst_spec):
        key = (src_spec, dst_spec, _redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN)
        return _memo(_prices, key, lambda: price(src_spec, dst_spec))

    planner = _redistribute.DTensorRedistributePlanner
    next_states, shortest_path = planner.get_next_state, planner.find_min_cost_path

    def kept_next_states(self, placements, shard_order):
        mesh, rank, size, targets = key = _graph_key(self)

        def priced():
            moves = lambda: _moves(self, next_states, placements, shard_order)  # noqa: E731
            return _priced(mesh, size, _memo(_graphs, (mesh, rank, targets, tuple(placements), shard_order), moves))

        return _memo(_graphs, (key, tuple(placements), shard_order), priced)

    def kept_shortest_path(self, src_state, dst_state):
        paths = _memo(_graphs, (_graph_key(self), src_state), lambda: _shortest_paths(self, src_state))
        return list(paths[dst_state]) if dst_state in paths else shortest_path(self, src_state, dst_state)

    _redistribute._gen_transform_infos_non_cached, strategies.redistribute_cost = kept, kept_price
    planner.get_next_state, planner.find_min_cost_path = kept_next_states, kept_shortest_path
    try:
        yield
    finally:
        _redistribute._gen_transform_infos_non_cached, strategies.redistribute_cost = original, price
        planner.get_next_state, planner.find_min_cost_path = next_states, shortest_path


def _graph_key(planner) -> tuple:
    """What a redistribution graph's edges and their costs depend on: (mesh, rank, bytes, the planner's targets)."""
    meta = planner.dtensor_meta
    targets = frozenset(planner.strided_shard_placements_in_target), frozenset(planner.partial_reduce_ops_in_target)
    return planner.device_mesh, planner.tensor_dimension, meta.dtype.itemsize * math.prod(meta.shape), targets


def _moves(planner, next_states, placements, shard_order) -> dict:
    """{state: (mesh dim, placement there before, after, shards before) or None} of the states one step from
    (placements, shard_order): torch's `get_next_state` with its step pricing replaced by what the price needs."""
    from torch.distributed.tensor.placement_types import _is_shard_like

    mesh = planner.device_mesh

    def move(src, dst):
        changed = [i for i, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
        if not changed:
            return None
        (dim,) = changed
        shards = math.prod(mesh.size(i) for i, p in enumerate(src.placements) if _is_shard_like(p))
        return dim, src.placements[dim], dst.placements[dim], shards

    pricing, planner.cost_function = planner.cost_function, move
    try:
        return next_states(planner, placements, shard_order)
    finally:
        planner.cost_function = pricing


def _priced(mesh, size: int, moves: dict) -> dict:
    """{state: cost} of `_moves` for a tensor of `size` bytes, as `one_step_redistribute_cost` prices a step
    (the same operations in the same order: equal floats)."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo, _compute_placement_transition_cost

    topo = MeshTopoInfo.build_from_mesh(mesh)
    costs = {}
    for state, move in moves.items():
        if move is None:
            costs[state] = 0.0
            continue
        dim, before, after, shards = move
        costs[state] = _compute_placement_transition_cost(before, after, topo, dim, size / shards / 1024 / 1024 / 1024)[
            0
        ]
    return costs


def _shortest_paths(planner, src) -> dict:
    """{state: DTensor's shortest path to it from `src`} for every state reachable from `src`: torch's search
    (`find_min_cost_path`: Dijkstra, ties broken by the order of discovery) run to the end instead of stopping at
    one target. Until a target is first reached, it pops exactly what torch's search for that target pops, so
    each path is the one torch would find."""
    import heapq

    from torch.distributed.tensor._redistribute import _redistribute_cost_sort_key

    paths, counter, queue = {}, 0, [(0.0, 0, 0.0, src, [src])]
    while queue:
        _, _, cost, state, path = heapq.heappop(queue)
        if state in paths:
            continue
        paths[state] = path
        for following, step in planner.get_next_state(state.placements, state.tensor_dim_to_mesh_dim).items():
            if following not in paths:
                counter += 1
                total = cost + step
                entry = (_redistribute_cost_sort_key(total), counter, total, following, path + [following])
                heapq.heappush(queue, entry)
    return paths


def _memo(store: dict, key, compute):
    """`store[key]`, computed by `compute()` the first time; the store is emptied when it outgrows its bound."""
    found = store.get(key)
    if found is None:
        if len(store) > _MAX_TRANSFORM_PLANS:
            store.clear()
        found = store[key] = compute()
    return found


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
