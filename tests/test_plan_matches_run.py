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
_COMM_DEBUG_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                    "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


def _key(c):
    return (c.module, c.kind, c.axes, c.bytes, c.phase, c.reason)


def _run_step(rank, world, spec, expected, ac="none"):
    sizes, flags = spmd.parse_spec(spec)
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
        again = spmd.explain(tiny_model(), spmd.Rules.default(sequence_parallel="sp" in flags), sizes,
                             batch_shape=(BATCH, SEQ))
        assert Counter(_key(c) for c in again.collectives) == expected


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_plan_lists_exactly_the_collectives_of_a_real_step(spec):
    plan = plan_for(spec)
    assert not [c for c in plan.collectives if c.origin == "implicit"], "the pass left a layout change to DTensor"
    expected = Counter(_key(c) for c in plan.collectives)
    run_distributed(_run_step, 4, spec, expected, timeout_s=240)


@pytest.mark.slow
def test_ac_plan_lists_exactly_the_collectives_of_a_real_checkpointed_step():
    spec = "fsdp=2,tp=2,sp"
    plan = spmd.explain(tiny_model(), spmd.Rules.default(sequence_parallel=True), spmd.parse_spec(spec)[0],
                        batch_shape=(BATCH, SEQ), ac="full")
    run_distributed(_run_step, 4, spec, Counter(_key(c) for c in plan.collectives), "full", timeout_s=240)


def test_recompute_regathers_each_block_as_one_bucket():
    """Under full checkpointing a block's recompute gathers its parameters as its forward did: one all-gather
    per block and fsdp axis in backward, not one per parameter (the real run equals this plan, above)."""
    plan = plan_for("fsdp=2,tp=2,sp", "full")
    blocks = {c.module.split(".")[1] for c in plan.collectives if c.module.startswith("layers.")}
    regathers = [c for c in plan.collectives if c.module.startswith("layers.") and c.phase == "backward"
                 and c.kind == "all_gather" and c.axes == ("fsdp",)]
    assert Counter(c.module for c in regathers) == {f"layers.{b}": 1 for b in blocks}, regathers
    n_params = len(list(tiny_model().layers[0].parameters()))
    assert all(f"({n_params} parameters, one buffer)" in c.reason for c in regathers), regathers
