"""DTensor's redistribution planning, kept per process: what it computes again for every op.

DTensor prices every candidate strategy of every op by its redistributions (1,331 for a matmul on three axes),
each by a shortest-path search. Prices depend on the specs alone (not their strides), a greedy plan's steps on
the placements (and whether the source is sharded), and graphs on mesh, rank and bytes, so they are kept
(`install`); one search runs from a source to every state, popping what torch's would, so every path is
torch's. Building each candidate's specs checks their shard order and whether the shape splits: functions of
placements, mesh sizes and shape, kept too. tests/test_search_speed.py compares the answers with `torchs()`,
torch planning alone.
"""

import contextlib
import math
import threading

from .selection import kept_choice

__all__ = ["install", "torchs", "memo"]

_TORCHS: dict = {}  # torch's own planning functions, put back by torchs()
_KEPT: dict = {}  # the functions install() put in their place
_transform_plans: dict = {}  # (src spec, dst spec, graph-based or not, override) -> plan; a greedy move: its steps
_pricing = threading.local()  # .on while this thread prices a move (its plan's steps are all that is read)
_prices: dict = {}  # (src spec, dst spec, torch's override) -> an op strategy's price of that move
_graphs: dict = {}  # (mesh, rank, bytes, targets) and a state -> its next states and costs, or its paths
_orders: dict = {}  # placements -> their default shard order
_verified: dict = {}  # (placements, shard order) -> True once torch's check passed
_shardable: dict = {}  # (shape, placements, mesh sizes, allow_unbacked) -> whether the shape splits so
_MAX_KEPT = 200_000  # entries of each store


def _targets() -> dict:
    """Where each of torch's planning functions that install() answers lives: {name: (module or class, attribute)}."""
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._ops import utils as op_utils

    planner = _redistribute.DTensorRedistributePlanner
    return {
        "transform": (_redistribute, "_gen_transform_infos_non_cached"),
        "cached": (_redistribute, "_gen_transform_infos"),
        "price": (op_utils, "redistribute_cost"),
        "next_states": (planner, "get_next_state"),
        "shortest_path": (planner, "find_min_cost_path"),
        "order": (DTensorSpec, "compute_default_shard_order"),  # (a staticmethod, kept as one)
        "verify": (DTensorSpec, "_verify_shard_order"),
        "shardable": (op_utils, "is_tensor_shardable"),
        "costs": (op_utils, "generate_redistribute_costs"),
        "expansion": (op_utils, "expand_to_full_mesh_op_strategy"),
        "choice": (_sharding_prop, "_select_min_cost_strategy"),
        "single_dim": (_sharding_prop, "_expand_single_dim_strategy_to_mesh"),
    }


def install() -> None:
    """Answers DTensor's planning from the stores, once per process (`torchs()` undoes it for a while)."""
    if _KEPT:
        return
    _TORCHS.update({name: vars(owner)[attr] for name, (owner, attr) in _targets().items()})
    next_states, shortest_path = _TORCHS["next_states"], _TORCHS["shortest_path"]

    def kept_next_states(self, placements, shard_order):
        mesh, rank, size, targets = key = _graph_key(self)

        def priced():
            moves = lambda: _moves(self, next_states, placements, shard_order)  # noqa: E731
            return _priced(mesh, size, memo(_graphs, (mesh, rank, targets, tuple(placements), shard_order), moves))

        return memo(_graphs, (key, tuple(placements), shard_order), priced)

    def kept_shortest_path(self, src_state, dst_state):
        paths = memo(_graphs, (_graph_key(self), src_state), lambda: _shortest_paths(self, src_state))
        return list(paths[dst_state]) if dst_state in paths else shortest_path(self, src_state, dst_state)

    _KEPT.update(_kept_moves(_TORCHS), next_states=kept_next_states, shortest_path=kept_shortest_path)
    _KEPT.update(_kept_spec_checks(_TORCHS), **kept_choice(_KEPT["price"], _TORCHS))
    _put(_KEPT)


def _kept_moves(torchs: dict) -> dict:
    """A move's plan kept per specs, and its price per specs without strides. A price's plan is answered by its
    steps alone, kept per placements for a greedy move (`_greedy`), and never enters torch's cache of plans,
    which real moves read for their shapes."""
    from torch.distributed.tensor import _redistribute

    original, cached, price = torchs["transform"], torchs["cached"], torchs["price"]

    def kept(src_spec, dst_spec, use_graph_based_transform=None):
        if getattr(_pricing, "on", False) and _greedy(src_spec, dst_spec, use_graph_based_transform):
            key = (src_spec.placements, dst_spec.placements, src_spec.num_shards > 1)
        else:
            key = (src_spec, dst_spec, use_graph_based_transform, _redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN)
        return list(memo(_transform_plans, key, lambda: original(src_spec, dst_spec, use_graph_based_transform)))

    def kept_cached(src_spec, dst_spec, use_graph_based_transform=None):
        if getattr(_pricing, "on", False):  # a price's plan stays out of the cache that real moves read
            return kept(src_spec, dst_spec, use_graph_based_transform)
        return cached(src_spec, dst_spec, use_graph_based_transform)

    def kept_price(src_spec, dst_spec):
        key = (_price_key(src_spec), _price_key(dst_spec), _redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN)
        return memo(_prices, key, lambda: _priced_move(price, src_spec, dst_spec))

    kept_cached.cache_clear = cached.cache_clear
    return {"transform": kept, "cached": kept_cached, "price": kept_price}


def _priced_move(price, src_spec, dst_spec) -> float:
    """torch's price of a move, its plan answered in this thread by steps kept per placements where greedy: a price
    reads a plan's steps, not the shapes on them, so they serve every shape and mesh size. Other threads' real
    moves plan as before."""
    outer, _pricing.on = getattr(_pricing, "on", False), True
    try:
        return price(src_spec, dst_spec)
    finally:
        _pricing.on = outer


def _greedy(src_spec, dst_spec, use_graph_based_transform) -> bool:
    """Whether torch plans this move greedily: its steps then depend on the placements alone and whether the source
    is sharded, not on shapes or mesh sizes (torch's `_gen_transform_infos_non_cached`)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import _StridedShard

    specs = src_spec, dst_spec
    if any(isinstance(p, _StridedShard) for s in specs for p in s.placements):
        return False
    forced = _redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN
    graph = forced if forced is not None else use_graph_based_transform
    return not graph and all(DTensorSpec.is_default_device_order(s.shard_order) for s in specs)


def _price_key(spec) -> tuple:
    """What a move's price reads of a spec: mesh, placements, shard order, shape and element size, not strides."""
    meta = spec.tensor_meta
    if meta is None:
        return (spec,)
    order = spec.shard_order, spec.use_strided_shard_as_shard_order
    return spec.mesh, spec.placements, order, tuple(meta.shape), meta.dtype.itemsize


def _kept_spec_checks(torchs: dict) -> dict:
    """A strategy's specs are built and checked per candidate (millions in a cold step): their default shard
    order, its check and whether a shape can be split are functions of placements, mesh sizes and shape."""
    order, verify, shardable = torchs["order"].__func__, torchs["verify"], torchs["shardable"]

    def kept_order(placements):
        return memo(_orders, placements, lambda: order(placements))

    def kept_verify(spec, shard_order) -> None:
        memo(_verified, (spec.placements, shard_order), lambda: verify(spec, shard_order) or True)

    def kept_shardable(shape, spec, allow_unbacked_sharding=None):
        if not all(type(n) is int for n in shape):  # symbolic sizes: torch's guards decide
            return shardable(shape, spec, allow_unbacked_sharding)
        key = (tuple(shape), spec.placements, spec.mesh.shape, allow_unbacked_sharding)
        return memo(_shardable, key, lambda: shardable(shape, spec, allow_unbacked_sharding))

    return {"order": staticmethod(kept_order), "verify": kept_verify, "shardable": kept_shardable}


def _put(functions: dict) -> None:
    for name, (owner, attr) in _targets().items():
        setattr(owner, attr, functions[name])


@contextlib.contextmanager
def torchs():
    """Within this scope DTensor plans as torch alone does (the kept answers are not asked, nor added to)."""
    if not _KEPT:
        yield
        return
    _put(_TORCHS)
    try:
        yield
    finally:
        _put(_KEPT)


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
    """{state: cost} of `_moves` for a tensor of `size` bytes, as `one_step_redistribute_cost` prices it."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo, _compute_placement_transition_cost

    topo = MeshTopoInfo.build_from_mesh(mesh)
    costs = {}
    for state, move in moves.items():
        if move is None:
            costs[state] = 0.0
        else:  # (dividing by 2**30 at once or by 1024 thrice: the same float)
            dim, before, after, shards = move
            costs[state], _ = _compute_placement_transition_cost(before, after, topo, dim, size / shards / 2**30)
    return costs


def _shortest_paths(planner, src) -> dict:
    """{state: torch's shortest path from `src`}: torch's Dijkstra run to the end, so paths are torch's."""
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


def memo(store: dict, key, compute, bound: int = _MAX_KEPT):
    """`store[key]`, computed once (emptied once it holds `bound`); an unhashable key (symbolic sizes) is not kept."""
    try:
        found = store.get(key)
    except TypeError:
        return compute()
    if found is None:
        if len(store) >= bound:
            store.clear()
        found = store[key] = compute()
    return found
