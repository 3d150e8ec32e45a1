"""What makes the search's dry runs (and a real run's first step) cheap changes no plan: DTensor's planning kept
per process (spmd/runtime/dtensor/planning.py) gives explain's plan as torch's own planner does."""

import contextlib

import torch

import spmd
from models.llama import Llama, LlamaConfig
from spmd.analysis import fake
from spmd.runtime.dtensor import planning


def _plan(model, sizes, batch_shape):
    plan = spmd.explain(model, spmd.Rules.default(True), sizes, batch_shape=batch_shape, ac="none")
    return [(c.kind, c.axes, c.bytes, c.phase, c.reason) for c in plan.collectives], plan.memory


def test_kept_transform_plans_give_torchs_plan():
    """With sequence parallelism (activations move between sequence- and feature-sharded layouts through
    DTensor's redistributions), explain with the kept plans, filled at one batch and then served from them at
    another, lists the same collectives (kind, axes, bytes, phase, reason) and memory as with torch's planner
    alone. Mutations it kills: the key without the target spec (`key = (src_spec, use_graph_based_transform,
    ...)` in spmd/runtime/dtensor/planning.py), a strategy's price kept without its target spec (`key = (src_spec,
    _redistribute._FORCE...)` in `kept_price`)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", kernels="torch"))
    sizes = {"fsdp": 2, "tp": 2}
    planning._transform_plans.clear()
    kept = [_plan(model, sizes, (4, 32))]
    filled = len(planning._transform_plans)
    kept.append(_plan(model, sizes, (8, 32)))
    assert filled > 0 and len(planning._transform_plans) >= filled
    with planning.torchs():
        assert kept[1] == _plan(model, sizes, (8, 32))


def test_kept_shortest_paths_are_torchs():
    """The shortest-path search under a redistribution plan, as a dry run keeps it (planning.install:
    run once from a state to every state, its graph shared by tensors of one rank and size), finds the path
    torch's own search finds (`find_min_cost_path`, stopped at the target, every step's cost computed), on a
    mesh of three axes whose graph holds Partial and _StridedShard states. Sources: states reached from
    replication; targets: every state reached from them; a second tensor of another shape and the same size
    is served from the first one's graph; the steps out of a state, kept once per (mesh, rank, targets) and
    priced per size, cost what torch's own pricing gives. Mutations it kills: ties broken in reverse order of
    discovery (`-counter` in `_shortest_paths`' queue entries), the graph keyed without the tensor's size, a
    step priced from the bytes before its shards (`size / 1` in `_priced`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner as Planner
    from torch.distributed.tensor.placement_types import _StridedShard

    planning.install()
    torchs = planning._TORCHS["next_states"], planning._TORCHS["shortest_path"]

    def torch_path(planner, src, dst):
        with planning.torchs():
            return planner.find_min_cost_path(src, dst)

    def planner(mesh, shape, dtype=torch.float32):
        made = Planner(mesh, TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), dtype))
        made.partial_reduce_ops_in_target.add("sum")
        made.strided_shard_placements_in_target.add(_StridedShard(0, split_factor=2))
        return made

    with fake.fake_world({"cp": 2, "fsdp": 2, "tp": 2}) as (mesh, _):
        planning._graphs.clear()
        first, same_size, small = (planner(mesh, shape) for shape in [(16, 8192, 4096), (8192, 16, 4096), (2, 2, 2)])
        reached = list(planning._shortest_paths(first, Planner.DistState((Replicate(),) * 3, ())))
        assert len(reached) > 50
        pairs = [(src, dst) for src in reached[:: len(reached) // 4] for dst in reached[:: len(reached) // 8]]
        by_size = 0
        for src, dst in pairs:
            kept = [p.find_min_cost_path(src, dst) for p in (first, same_size, small)]
            assert kept[1] == torch_path(same_size, src, dst) and kept[2] == torch_path(small, src, dst), (src, dst)
            by_size += kept[1] != kept[2]
        assert len(pairs) > 30 and by_size > 3  # the sample holds paths that differ with the tensor's size
        for state in reached[:: len(reached) // 16]:  # each step priced per size as torch prices it, to the bit
            fields = state.placements, state.tensor_dim_to_mesh_dim
            for p in (first, small):
                assert p.get_next_state(*fields) == torchs[0](p, *fields), state


def test_kept_spec_checks_and_prices_are_torchs():
    """A strategy's spec checks and a move's price, as a dry run keeps them (planning.install: shardability per
    shape, placements and mesh sizes; the price without strides, a greedy move's steps per placements), answer as
    torch's own functions do, for layouts over tensors of several shapes and strides on three meshes of three axes
    (of other sizes, one of size 1): one shape splits where another does not, moves of one layout cost more for
    more bytes, nested and reordered shardings take several steps. A real move's plan (its shapes too) stays
    torch's after the prices, and in another thread while this one prices. Mutations it kills: the price keyed
    without the shape (`_price_key`), shardability keyed without the shape (`kept_shardable`), a price's steps
    put in torch's cache of plans for real moves (`kept_cached` ignoring `_pricing`), every move taken for a greedy
    one (`_greedy`), greedy steps keyed without the target placements or whether the source is sharded, one
    pricing flag for every thread."""
    from torch.distributed.tensor import Partial, Replicate, Shard, _redistribute
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor._ops import utils as op_utils

    planning.install()
    torch_price, torch_shardable = planning._TORCHS["price"], planning._TORCHS["shardable"]
    torch_plan = planning._TORCHS["transform"]
    layouts = [(Shard(0), Replicate(), Shard(1)), (Replicate(), Shard(1), Partial()), (Shard(1), Shard(0), Replicate())]
    layouts += [(Replicate(),) * 3, (Shard(0), Shard(0), Replicate()), (Replicate(), Shard(0), Shard(0))]
    layouts += [(Shard(0), Replicate(), Partial()), (Replicate(), Shard(1), Replicate())]  # on fsdp=1: one shard
    reordered = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)  # dim 0 split over mesh dim 1, then 0
    splits, prices = set(), set()
    for store in (planning._prices, planning._shardable, planning._transform_plans):
        store.clear()
    for sizes in ({"cp": 2, "fsdp": 2, "tp": 2}, {"dp": 4, "fsdp": 2, "tp": 2}, {"cp": 2, "fsdp": 1, "tp": 2}):
        with fake.fake_world(sizes) as (mesh, _):

            def spec(placements, shape, transposed):
                t = torch.empty(shape[::-1] if transposed else shape, device="meta")
                t = t.t() if transposed else t
                order = reordered if placements == (Shard(0), Shard(0), Replicate()) and shape[0] == 8 else None
                meta = TensorMeta(t.shape, t.stride(), torch.float32)
                return DTensorSpec(mesh, placements, tensor_meta=meta, shard_order=order)

            for shape in [(1, 8), (8, 8), (4, 16), (3, 5)]:
                for transposed in (False, True):
                    for src in layouts:
                        s = spec(src, shape, transposed)
                        splits.add(torch_shardable(shape, s))
                        assert op_utils.is_tensor_shardable(shape, s) == torch_shardable(shape, s), (shape, src)
                        for dst in layouts:
                            d = spec(dst, shape, transposed)
                            with planning.torchs():  # torch's answer now, as a dry run asks (no cached plan)
                                _redistribute._gen_transform_infos.cache_clear()
                                price, plan = torch_price(s, d), torch_plan(s, d)
                            _redistribute._gen_transform_infos.cache_clear()  # the kept price plans into an empty cache
                            prices.add(price)
                            assert op_utils.redistribute_cost(s, d) == price, (sizes, shape, src, dst)
                            if price not in (0.0, float("inf")):  # real moves: plans with their shapes
                                assert _redistribute._gen_transform_infos(s, d) == plan, (sizes, shape, src, dst)
                                assert _redistribute._gen_transform_infos_non_cached(s, d) == plan
    assert splits == {True, False} and len(prices) > 8
    _graph_moves_priced_as_torchs(torch_price)
    _another_threads_moves_plan_as_torchs(torch_plan)


def _another_threads_moves_plan_as_torchs(torch_plan):
    """While one thread prices a move (its plan's steps kept per placements, their shapes another tensor's),
    another thread's real move of those placements gets torch's plan, shapes and all."""
    import threading

    from torch.distributed.tensor import Replicate, Shard, _redistribute
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    with fake.fake_world({"cp": 2, "fsdp": 2, "tp": 2}) as (mesh, _):
        src, dst = (Shard(0), Replicate(), Shard(1)), (Replicate(),) * 3
        specs = [
            [
                DTensorSpec(mesh, p, tensor_meta=TensorMeta(torch.Size(shape), (shape[1], 1), torch.float32))
                for p in (src, dst)
            ]
            for shape in [(8, 8), (4, 16)]
        ]
        planning._transform_plans.clear()
        planning._pricing.on = True
        try:
            steps = _redistribute._gen_transform_infos_non_cached(*specs[0])  # this thread: steps kept
            real = []
            thread = threading.Thread(
                target=lambda: real.append(_redistribute._gen_transform_infos_non_cached(*specs[1]))
            )
            thread.start()
            thread.join()
        finally:
            planning._pricing.on = False
        with planning.torchs():
            assert real == [torch_plan(*specs[1])] and steps != real[0]


def _graph_moves_priced_as_torchs(torch_price):
    """Moves torch plans by its graph keep their own price per size (the shortest path changes with the bytes,
    test_kept_shortest_paths_are_torchs): a reordered sharding, a _StridedShard read as a plain shard, and any move
    under torch's `use_min_cost_redistribution_plan`."""
    from torch.distributed.tensor import Replicate, Shard, _redistribute
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor._ops import utils as op_utils
    from torch.distributed.tensor._redistribute import use_min_cost_redistribution_plan
    from torch.distributed.tensor.placement_types import _StridedShard

    reordered = (ShardOrderEntry(tensor_dim=0, mesh_dims=(2, 0)),)
    strided = (Replicate(), Replicate(), _StridedShard(0, split_factor=2))
    layouts = [((Shard(0), Replicate(), Shard(0)), reordered), (strided, None)]
    layouts += [((Replicate(), Replicate(), Shard(1)), None), ((Replicate(), Shard(0), Replicate()), None)]
    layouts += [((Shard(0), Replicate(), Shard(0)), None)]
    with fake.fake_world({"cp": 2, "fsdp": 2, "tp": 2}) as (mesh, _):
        for forced in (None, True):
            planning._prices.clear()
            planning._transform_plans.clear()
            for shape in [(16, 8192, 4096), (2, 2, 2)]:
                meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), torch.float32)
                specs = [
                    DTensorSpec(mesh, p, tensor_meta=meta, shard_order=order, use_strided_shard_as_shard_order=False)
                    for p, order in layouts
                ]
                with use_min_cost_redistribution_plan(forced) if forced else contextlib.nullcontext():
                    for s in specs:
                        for d in specs:
                            with planning.torchs():
                                _redistribute._gen_transform_infos.cache_clear()
                                price = torch_price(s, d)
                            assert op_utils.redistribute_cost(s, d) == price, (forced, shape, s, d)
