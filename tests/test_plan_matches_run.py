"""explain() on a fake world lists exactly the collectives a real step issues (its memory is held against
real tensors in tests/test_spmd_numerics.py).

The plan is made in the test process (no process group); the real step runs on four gloo processes
under torch's CommDebugMode and spmd's recorder. Both lists must agree record for record (module, kind,
mesh axes, bytes, phase), and CommDebugMode's independent count per collective type must agree too.
"""

from collections import Counter

import pytest
from torch.distributed.tensor.debug import CommDebugMode

import spmd
from spmd.analysis.record import CollectiveRecorder
from tests.dist_utils import run_distributed
from tests.spmd_cases import BATCH, SEQ, global_batch, local_slice, plan_for, tiny_model

SPECS = ["fsdp=2,tp=2,sp", "dp=2,fsdp=2", "tp=4"]
_COMM_DEBUG_KIND = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "allreduce_": "all_reduce",
}  # (c10d's: flat buffers sum in place)


def _key(c):
    return (c.module, c.kind, c.axes, c.bytes, c.phase, c.reason)


def _run_step(rank, world, spec, expected, ac="none"):
    sizes, flags = spmd.parse_spec(spec)
    # a fresh mesh per case, though the last case repeats the first's layout: DTensor caches its plans by mesh
    # layout and runs them over the first equal mesh's groups, which the recorder names by their ranks
    mesh = spmd.make_mesh(sizes)
    model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default(sequence_parallel="sp" in flags))
    spmd.apply_activation_checkpointing(model, ac)  # after parallelize, as launch.train does
    tokens, targets = global_batch(0)
    recorder = CollectiveRecorder(mesh)
    with CommDebugMode() as comm, recorder:
        model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
    got = Counter(_key(c) for c in recorder.records)
    assert got == expected, f"{spec}: real run minus plan {got - expected}, plan minus real run {expected - got}"
    by_kind = Counter()
    for op, n in comm.get_comm_counts().items():
        by_kind[_COMM_DEBUG_KIND[op.__name__.split(".")[0]]] += n
    planned_kinds = Counter()
    for key, n in expected.items():
        planned_kinds[key[1]] += n
    assert by_kind == planned_kinds, f"{spec}: CommDebugMode saw {by_kind}, plan has {planned_kinds}"
    if rank == 0 and spec == SPECS[0] and ac == "none":
        # inside a real process group, explain runs its fake world in a fresh interpreter: same plan
        again = spmd.explain(
            tiny_model(), spmd.Rules.default(sequence_parallel="sp" in flags), sizes, batch_shape=(BATCH, SEQ)
        )
        assert Counter(_key(c) for c in again.collectives) == expected


def _each_step(rank, world, cases):
    for case in cases:
        _run_step(rank, world, *case)


@pytest.mark.slow
def test_plan_lists_exactly_the_collectives_of_a_real_step():
    """Each of SPECS, then fsdp=2,tp=2,sp under full activation checkpointing on a second mesh of that layout, in
    one launch (a process's later specs reuse DTensor's sharding rules decided for its first). Mutation that
    fails it (tried): CollectiveRecorder naming a group it does not know by its name, not by its ranks."""
    cases = []
    for spec in SPECS:
        plan = plan_for(spec)
        assert not [c for c in plan.collectives if c.origin == "implicit"], "the pass left a layout change to DTensor"
        cases.append((spec, Counter(_key(c) for c in plan.collectives)))
    spec = "fsdp=2,tp=2,sp"
    plan = spmd.explain(
        tiny_model(),
        spmd.Rules.default(sequence_parallel=True),
        spmd.parse_spec(spec)[0],
        batch_shape=(BATCH, SEQ),
        ac="full",
    )
    cases.append((spec, Counter(_key(c) for c in plan.collectives), "full"))
    run_distributed(_each_step, 4, cases, timeout_s=600)


def test_recompute_regathers_each_block_as_one_bucket():
    """Under full checkpointing a block's recompute gathers its parameters as its forward did: one all-gather
    per block and fsdp axis in backward, not one per parameter (the real run equals this plan, above)."""
    plan = plan_for("fsdp=2,tp=2,sp", "full")
    blocks = {c.module.split(".")[1] for c in plan.collectives if c.module.startswith("layers.")}
    regathers = [
        c
        for c in plan.collectives
        if c.module.startswith("layers.") and c.phase == "backward" and c.kind == "all_gather" and c.axes == ("fsdp",)
    ]
    assert Counter(c.module for c in regathers) == {f"layers.{b}": 1 for b in blocks}, regathers
    n_params = len(list(tiny_model().layers[0].parameters()))
    assert all(f"({n_params} parameters, one buffer)" in c.reason for c in regathers), regathers


def _native_counts(spec: str) -> Counter:
    """Collectives of one forward + backward of the tiny model under torch's own data parallelism: DDP for dp,
    FSDP2 (`fully_shard` per block, then the root) for fsdp."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = tiny_model()
    if spec.startswith("dp="):
        model = DistributedDataParallel(model)
    else:
        mesh = spmd.make_mesh({"fsdp": dist.get_world_size()})
        for block in model.layers:
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"], reshard_after_forward=False)
    tokens, targets = global_batch(0)
    r, b = dist.get_rank(), BATCH // dist.get_world_size()
    with CommDebugMode() as comm:
        model(tokens[r * b : (r + 1) * b], targets[r * b : (r + 1) * b]).backward()
    return Counter({op.__name__: n for op, n in comm.get_comm_counts().items()})


def _data_parallel_step_no_more_than_native(rank, world, plans):
    for spec, expected in plans.items():
        _run_step(rank, world, spec, expected)  # the plan is the real step, record for record
        mesh = spmd.make_mesh(spmd.parse_spec(spec)[0])
        model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default())
        tokens, targets = global_batch(0)
        with CommDebugMode() as comm:
            model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
        ours, native = comm.get_total_counts(), _native_counts(spec)
        if rank == 0:
            print(
                f"{spec}: spmd {ours} collectives per forward + backward {dict(comm.get_comm_counts())}, "
                f"native {sum(native.values())} {dict(native)}"
            )
        assert ours <= sum(native.values()), f"{spec}: spmd issues {ours} collectives, torch-native {native}"


@pytest.mark.slow
def test_data_parallel_issues_no_more_collectives_than_ddp_and_fsdp2():
    """dp=4 against DDP and fsdp=4 against FSDP2, counted by CommDebugMode in the same processes: the root
    unit gathers once, the gradients of every block reduce in one DDP-sized buffer, so spmd's count (the
    loss's all-reduce included) is at most torch's own."""
    plans = {spec: Counter(_key(c) for c in plan_for(spec).collectives) for spec in ("dp=4", "fsdp=4")}
    run_distributed(_data_parallel_step_no_more_than_native, 4, plans, timeout_s=300)
