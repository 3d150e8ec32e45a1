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


def _choices(model, sizes, sp, batch_shape) -> list:
    """(op, DTensor's output sharding) of every op a dry run propagates."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    seen, propagate = [], ShardingPropagator.propagate_op_sharding_non_cached

    def recorded(self, op_schema):
        out = propagate(self, op_schema)
        seen.append((str(op_schema.op), repr(out)))
        return out

    ShardingPropagator.propagate_op_sharding_non_cached = recorded
    try:
        spmd.explain(model, spmd.Rules.default(sp), sizes, batch_shape=batch_shape, ac="none")
    finally:
        ShardingPropagator.propagate_op_sharding_non_cached = propagate
    return seen


def test_choices_build_and_price_few_candidates_and_are_torchs(monkeypatch):
    """DTensor's choice of each op's strategy, with the expansion narrowed to the rows that move no input on some
    mesh dim and prices worked out only when read (spmd/runtime/dtensor/selection.py), is the choice of torch's full
    expansion with every price worked out (its `expand_to_full_mesh_op_strategy`, `generate_redistribute_costs` and
    `_select_min_cost_strategy`), for every op of a dry run on a mesh of three axes whose activations hold
    _StridedShard layouts (batch over dp, sequence over cp, flattened) and of one with sequence parallelism; the
    kept way builds and prices a small share of the candidates."""
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor._ops import utils as op_utils

    from spmd.runtime.dtensor import selection

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", kernels="torch"))
    planning.install()
    strided = []
    for sizes, sp in [({"cp": 2, "dp": 2, "tp": 2}, False), ({"dp": 2, "fsdp": 2, "tp": 2}, True)]:
        made, rows = [], []
        monkeypatch.setattr(selection.Prices, "__init__", _counted(selection.Prices.__init__, made))
        kept = _choices(model, sizes, sp, (8, 64))
        monkeypatch.undo()
        monkeypatch.setattr(op_utils, "expand_to_full_mesh_op_strategy", planning._TORCHS["expansion"])
        monkeypatch.setattr(op_utils, "generate_redistribute_costs", _counted(planning._TORCHS["costs"], rows))
        monkeypatch.setattr(_sharding_prop, "_select_min_cost_strategy", planning._TORCHS["choice"])
        assert kept == _choices(model, sizes, sp, (8, 64)), sizes
        monkeypatch.undo()
        assert sum(row._values is not None for row in made) < len(made) < 0.1 * len(rows), (len(made), len(rows))
        strided.append(sum("_StridedShard" in out for _, out in kept))
    assert strided[0] > 10


def _counted(function, made):
    """`function`, noting in `made` each call's first argument (a `Prices` row being built) or else its answer."""

    def counted(*args):
        answer = function(*args)
        made.append(args[0] if answer is None else answer)
        return answer

    return counted


def test_a_choice_among_candidates_that_move_no_input_is_torchs():
    """Where several candidates move no input, the kept choice takes torch's: the last of them that costs nothing
    (one that keeps the placements but not the shard order costs something), reading no other candidate's prices;
    a price is the one of its target spec as built, even when DTensor sets the spec's shard order before it
    chooses (`_propagate_use_strided_shard_flag`). Mutations it kills: the first such candidate taken
    (`reversed` dropped in `kept_choice`'s `choice`), its cost not checked, the target read as it is when read."""
    from torch.distributed.tensor import Replicate, Shard, _sharding_prop
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    from torch.distributed.tensor._ops import utils as op_utils
    from torch.distributed.tensor.placement_types import _StridedShard

    from spmd.runtime.dtensor import selection

    planning.install()
    reordered = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    meta = TensorMeta(torch.Size((64, 32)), (32, 1), torch.float32)
    with fake.fake_world({"cp": 2, "fsdp": 2, "tp": 2}) as (mesh, _):

        def spec(placements, order=None, strided=None):
            return DTensorSpec(
                mesh, placements, tensor_meta=meta, shard_order=order, use_strided_shard_as_shard_order=strided
            )

        def chosen(costs, choice, args, candidates):
            options = []
            for out, ins in candidates:
                prices = [costs(OpStrategy([OpSpec(a)]), i) for a, i in zip(args, ins)]
                options.append(OpSpec(out, input_specs=ins, redistribute_cost=prices))
            schema = OpSchema(torch.ops.aten.add.Tensor, tuple(args), {})
            picked = choice(OpStrategy(options), schema)
            return options.index(picked), options

        S0, R = Shard(0), Replicate()
        x, y = spec((S0, S0, R), reordered), spec((R, R, R))
        same = [spec((S0, S0, R), reordered), spec((R, R, R))]
        moved = [spec((S0, R, R)), spec((S0, R, R))]
        cases = [
            [(spec((S0, S0, R)), moved), (spec((R, S0, R)), same), (spec((S0, S0, R)), same), (spec((R, R, R)), moved)],
            [(spec((S0, S0, R)), same), (spec((R, S0, R)), [spec((S0, S0, R)), y]), (spec((R, R, R)), moved)],
        ]
        for candidates in cases:
            kept, options = chosen(
                op_utils.generate_redistribute_costs, _sharding_prop._select_min_cost_strategy, (x, y), candidates
            )
            torchs, _ = chosen(planning._TORCHS["costs"], planning._TORCHS["choice"], (x, y), candidates)
            assert kept == torchs, (kept, torchs)
            assert all(row._values is None for row in options[-1].redistribute_cost)  # moves an input: never read
        assert (kept, torchs) == (0, 0)  # the last candidate keeping the placements reorders: it costs something

        strided = (R, S0, _StridedShard(0, split_factor=2))
        built = spec(strided, strided=False)
        prices = selection.Prices(op_utils.redistribute_cost, [OpSpec(spec((S0, R, R)))], built)
        built.use_strided_shard_as_shard_order, built.shard_order = True, None  # as DTensor sets it before choosing
        with planning.torchs():
            as_built = op_utils.redistribute_cost(spec((S0, R, R)), spec(strided, strided=False))
        assert list(prices) == [as_built] and as_built != float("inf")


def test_a_narrowed_expansion_chooses_as_the_full_one():
    """The expansion narrowed to the rows that move no input on some mesh dim (`kept_choice`'s `expansion` in
    spmd/runtime/dtensor/selection.py) serves only when a candidate of it moves no input and costs nothing; then
    DTensor's choice over it is its choice over the full expansion. Cases: the candidates that keep the placements
    but not the shard order of an input (they cost something: the full expansion serves), and an op of two outputs
    whose rows keep the inputs on one mesh dim in two ways (the last is chosen). Mutations it kills: a narrowed
    candidate taken without its cost checked (`_free`), a row's outputs read as inputs (`row[1:]` in
    `_rows_keeping_a_dim`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    planning.install()
    S0, S1, R = Shard(0), Shard(1), Replicate()
    meta = TensorMeta(torch.Size((64, 32)), (32, 1), torch.float32)
    with fake.fake_world({"cp": 2, "fsdp": 2, "tp": 2}) as (mesh, _):

        def chosen(functions, args, rows, outputs):
            schema = OpSchema(torch.ops.aten.add.Tensor, tuple(OpStrategy([OpSpec(a)]) for a in args), {})
            strategy = functions["expansion"](mesh, schema, rows, input_index=outputs)
            picked = functions["choice"](strategy, OpSchema(torch.ops.aten.add.Tensor, tuple(args), {}))
            specs = (*picked.output_specs,) if outputs > 1 else (picked.output_spec,)
            return [s.placements for s in (*specs, *picked.input_specs)], len(strategy.strategies)

        def kept(args, rows, outputs=1):
            answer, candidates = chosen(planning._KEPT, args, rows, outputs)
            torchs, full = chosen(planning._TORCHS, args, rows, outputs)
            assert answer == torchs, (args, rows)
            return answer, candidates, full

        reordered = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
        x = DTensorSpec(mesh, (S0, S0, R), tensor_meta=meta, shard_order=reordered)
        y = DTensorSpec(mesh, (S0, S0, R), tensor_meta=meta)
        elementwise = [[S0, S0, S0], [S1, S1, S1], [R, R, R]]
        _, candidates, full = kept((x, y), elementwise)
        assert candidates == full == 27  # the candidates keeping x's placements cost a reorder: no narrowing

        x, y = (DTensorSpec(mesh, (S0, R, R), tensor_meta=meta) for _ in range(2))
        two_outputs = [[S0, S0, S0, S0], [S1, R, S0, S0], [R, R, R, R], [S1, S1, S1, S1]]
        answer, candidates, full = kept((x, y), two_outputs, outputs=2)
        assert answer[:2] == [(S1, R, R), (R, R, R)] and candidates < full  # the last that keeps them


def test_foreach_ops_and_symbolic_shapes_choose_as_torch():
    """Where the narrowed choice would not be torch's, the full expansion serves: a foreach op (torch chooses each
    element without the op's schema: the first cheapest candidate, here one that moves an input to Partial(avg)
    at no cost), an unbacked size (torch's shardability check of a candidate that splits it raises), and a backed
    symbolic size (torch's checks leave shape guards). Compared with torch's own propagation. Mutations it kills:
    foreach ops narrowed (`single_dim_expansion` returning `expanded` always), symbolic shapes narrowed
    (`_concrete` answering True)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    planning.install()
    aten, R = torch.ops.aten, Replicate()
    meta = TensorMeta(torch.Size((64, 32)), (32, 1), torch.float32)
    with fake.fake_world({"cp": 2, "fsdp": 2, "tp": 2}) as (mesh, _):
        propagator = DTensor._op_dispatcher.sharding_propagator

        def propagated(op, args):
            schema = OpSchema(op, args, {}, schema_info=propagator.op_to_schema_info.get(op))
            try:
                return repr(propagator.propagate_op_sharding_non_cached(schema))
            except Exception as e:  # torch's own refusal, to be met the same way
                return type(e).__name__

        def as_torch(op, make_args):
            kept = propagated(op, make_args())
            with planning.torchs():
                assert kept == propagated(op, make_args()), op
            return kept

        a, b = (
            DTensorSpec(mesh, (Partial("avg"), R, R), tensor_meta=meta),
            DTensorSpec(mesh, (R,) * 3, tensor_meta=meta),
        )
        assert "needs_redistribute=True" in as_torch(aten._foreach_add.List, lambda: ([a], [b]))  # b to Partial(avg)

        def layer_norm_args(size):
            x_meta = TensorMeta(torch.Size((size, 64, 32)), (64 * 32, 32, 1), torch.float32)
            w = DTensorSpec(mesh, (R, R, R), tensor_meta=TensorMeta(torch.Size((32,)), (1,), torch.float32))
            return (DTensorSpec(mesh, (R, R, Shard(1)), tensor_meta=x_meta), [32], w, w, 1e-5)

        env = ShapeEnv()
        with FakeTensorMode(shape_env=env):
            unbacked = env.create_unbacked_symint()
            assert (
                as_torch(aten.native_layer_norm.default, lambda: layer_norm_args(unbacked))
                == "GuardOnDataDependentSymNode"
            )

        guards = []
        for _ in range(2):  # the kept way, then torch's: each in a shape environment of its own
            env = ShapeEnv()
            symbol = env.create_symbol(16, ConstantSource("batch"), dynamic_dim=DimDynamic.DYNAMIC)
            with FakeTensorMode(shape_env=env):
                args = layer_norm_args(env.create_symintnode(symbol, hint=16))
                with planning.torchs() if guards else contextlib.nullcontext():
                    propagated(aten.native_layer_norm.default, args)
            guards.append([str(g.expr) for g in env.guards])
        assert guards[0] == guards[1] and guards[0]
