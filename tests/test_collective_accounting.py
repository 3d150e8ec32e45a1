"""Collectives of one step of the tiny model, planned on fake meshes, against the reference formulas.

The formulas are those of shared/DESIGN.md with the ring convention of spmd.analysis.record (bytes per rank on
the wire: all-gather and reduce-scatter S*(n-1)/n, all-reduce 2*S*(n-1)/n). Each test prints the ratio
measured/expected; the assertions demand exactly 1. The loss's own all-reduces (a few floats, issued by
the vocab-parallel cross-entropy) are outside the formulas and excluded by origin.
"""

import re

import pytest
import torch

import spmd
from tests.spmd_cases import BATCH, SEQ, tiny_model

F32 = 4


def plan_for(spec, batch=(BATCH, SEQ)):
    sizes, flags = spmd.parse_spec(spec)
    return spmd.explain(tiny_model(), spmd.Rules.default(sequence_parallel="sp" in flags), sizes, batch_shape=batch)


def planned(plan, kind=None, axes=None, phase=None, why=None, module=None):
    return [
        c
        for c in plan.collectives
        if c.origin == "planned"
        and (kind is None or c.kind == kind)
        and (axes is None or c.axes == (axes,))
        and (phase is None or c.phase == phase)
        and (why is None or c.reason.startswith(why))
        and (module is None or re.fullmatch(module, c.module))
    ]


def report(name, measured, expected):
    print(f"{name}: measured {measured:,} expected {expected:,} ratio {measured / expected:.4f}")
    assert measured == expected, name


def per_block(records, layer=0):
    return [c for c in records if c.module.startswith(f"layers.{layer}.") or c.module == f"layers.{layer}"]


def param_bytes(model, names=None):
    return sum(p.numel() * F32 for n, p in model.named_parameters() if names is None or names(n))


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_is_two_all_reduces_forward_and_two_backward_per_block(t):
    plan = plan_for(f"tp={t}")
    cfg = tiny_model().cfg
    S = BATCH * SEQ * cfg.dim * F32
    fwd = planned(plan, "all_reduce", "tp", "forward")
    bwd = planned(plan, "all_reduce", "tp", "backward", why="backward of move input")
    for layer in range(cfg.n_layers):
        report(f"tp={t} block {layer} forward all-reduces", len(per_block(fwd, layer)), 2)
        report(f"tp={t} block {layer} backward all-reduces", len(per_block(bwd, layer)), 2)
        block_bytes = sum(c.bytes for c in per_block(fwd + bwd, layer))
        report(f"tp={t} block {layer} bytes (Megatron 8bsh(t-1)/t)", block_bytes, 8 * S * (t - 1) // t)
    # outside the blocks: the vocab-parallel embedding's all-reduce, the output head's backward all-reduce
    report("tp embedding all-reduce", len([c for c in fwd if c.module == "tok_embeddings"]), 1)
    report("tp output backward all-reduce", len([c for c in bwd if c.module == "output"]), 1)
    assert not [c for c in plan.collectives if c.origin == "implicit"]


def test_sequence_parallel_turns_each_all_reduce_into_all_gather_plus_reduce_scatter():
    t = 4
    plan = plan_for(f"tp={t},sp")
    cfg = tiny_model().cfg
    S = BATCH * SEQ * cfg.dim * F32
    for layer in range(cfg.n_layers):
        block = per_block(planned(plan, axes="tp"), layer)
        for phase in ("forward", "backward"):
            for kind in ("all_gather", "reduce_scatter"):
                got = [c for c in block if c.phase == phase and c.kind == kind]
                report(f"sp block {layer} {phase} {kind}", len(got), 2)
                assert all(c.bytes == S * (t - 1) // t for c in got)
        act_bytes = sum(c.bytes for c in block if c.kind != "all_reduce")
        report(f"sp block {layer} activation bytes (same as TP)", act_bytes, 8 * S * (t - 1) // t)
    # sequence-sharded norms (two a block, the final one) see different tokens on each rank: their weight
    # gradients all-reduce, every block's in one buffer (spmd.runtime.gradients.reducer)
    norms = planned(plan, "all_reduce", "tp", "backward", why="all-reduce gradients")
    report("sp norm-gradient all-reduces", len(norms), 1)
    report(
        "sp norm-gradient bytes",
        sum(c.bytes for c in norms),
        2 * ((2 * cfg.n_layers + 1) * cfg.dim * F32 * (t - 1) // t),
    )
    assert all(d.choice == "gather activation" for d in plan.decisions)
    assert not [c for c in plan.collectives if c.origin == "implicit"]


def test_norm_gradients_replicated_over_dp_and_tp_reduce_once_over_both():
    """dp=2,tp=2,sp: a norm weight sees other tokens on every rank of dp x tp; its gradient is summed in one
    all-reduce over the flattened group of 4 (2 S (4-1)/4 bytes), not one per axis (2 S (2-1)/2 twice)."""
    plan = plan_for("dp=2,tp=2,sp")
    cfg = tiny_model().cfg
    n, norms = 4, (2 * cfg.n_layers + 1) * cfg.dim * F32
    both = [c for c in planned(plan, "all_reduce", phase="backward") if c.axes == ("dp", "tp")]
    report("dp x tp norm-gradient all-reduces", len(both), 1)
    report("dp x tp norm-gradient bytes", both[0].bytes, 2 * norms * (n - 1) // n)
    assert not planned(plan, "all_reduce", "tp", "backward", why="all-reduce gradients")


def test_fsdp_moves_three_psi():
    n = 4
    plan = plan_for(f"fsdp={n}")
    model = tiny_model()
    psi = param_bytes(model)
    ring = lambda b: b * (n - 1) // n  # noqa: E731
    report("fsdp forward all-gather", sum(c.bytes for c in planned(plan, "all_gather", "fsdp", "forward")), ring(psi))
    # backward regathers the blocks' weights; the root unit (embedding, final norm, output) stays gathered
    # from forward to backward, as FSDP2's root does
    outside = param_bytes(model, lambda name: not name.startswith("layers."))
    report(
        "fsdp backward all-gather",
        sum(c.bytes for c in planned(plan, "all_gather", "fsdp", "backward")),
        ring(psi - outside),
    )
    assert len(planned(plan, "all_gather", "fsdp", "forward")) == len(model.layers) + 1  # one per unit
    report("fsdp reduce-scatter", sum(c.bytes for c in planned(plan, "reduce_scatter", "fsdp", "backward")), ring(psi))
    assert not planned(plan, "all_reduce")


def test_data_parallel_moves_two_psi():
    n = 4
    plan = plan_for(f"dp={n}")
    psi = param_bytes(tiny_model())
    report(
        "dp gradient all-reduce",
        sum(c.bytes for c in planned(plan, "all_reduce", "dp", "backward")),
        2 * psi * (n - 1) // n,
    )
    # DDP's buckets: every gradient, blocks and root unit alike, in one all-reduce while they fit the first (1 MB)
    assert psi < 2**20
    assert len(planned(plan, "all_reduce", "dp", "backward")) == 1


def test_data_parallel_first_buffer_goes_out_at_ddps_first_bucket_size():
    """As DDP's first bucket (1 MB): the first gradients of backward (the last block's) are all-reduced while
    the rest of backward runs, and the others follow in one buffer; as many buffers as DDP assigns buckets."""
    import torch.distributed as dist

    n, model = 4, tiny_model(dim=256, ffn_dim=768)  # 7 MB of gradients: more than DDP's first bucket
    plan = spmd.explain(model, spmd.Rules.default(), {"dp": n}, batch_shape=(BATCH, SEQ))
    reduced = planned(plan, "all_reduce", "dp", "backward")
    last = param_bytes(model, lambda name: name.startswith(f"layers.{len(model.layers) - 1}."))
    first = reduced[0].bytes * n // (2 * (n - 1))  # the buffer's gradient bytes
    print(f"first buffer {first:,} bytes of the last block's {last:,}: {reduced[0].reason}")
    assert 2**20 <= first < last and f"gradients of layers.{len(model.layers) - 1} (" in reduced[0].reason
    report("dp gradient all-reduce", sum(c.bytes for c in reduced), 2 * param_bytes(model) * (n - 1) // n)
    params = list(model.parameters())
    buckets, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20], [False] * len(params)
    )
    assert len(reduced) == len(buckets) == 2


def test_hsdp_gathers_over_fsdp_and_all_reduces_shards_over_dp():
    plan = plan_for("dp=2,fsdp=2")
    model = tiny_model()
    psi = param_bytes(model)
    report("hsdp reduce-scatter over fsdp", sum(c.bytes for c in planned(plan, "reduce_scatter", "fsdp")), psi // 2)
    report(
        "hsdp all-reduce of shards over dp",
        sum(c.bytes for c in planned(plan, "all_reduce", "dp")),
        2 * (psi // 2) // 2,
    )
    # every block's gradients and the root unit's in one buffer while they fit 25 MB: one reduce-scatter, then
    # one all-reduce of its shards (FSDP2's HSDP does both per unit)
    report("hsdp reduce-scatters", len(planned(plan, "reduce_scatter", "fsdp")), 1)
    report("hsdp all-reduces", len(planned(plan, "all_reduce", "dp")), 1)
    # the loss's (sum, count) over the ranks that split the batch: one all-reduce over the flattened dp x fsdp
    loss = [c for c in plan.collectives if c.origin == "op" and c.kind == "all_reduce"]
    assert [c.axes for c in loss] == [("dp", "fsdp")], loss
    report(
        "hsdp forward all-gather over fsdp",
        sum(c.bytes for c in planned(plan, "all_gather", "fsdp", "forward")),
        psi // 2,
    )


@pytest.mark.parametrize("spec,n", [("fsdp=4", 4), ("dp=4", 1), ("dp=2,fsdp=2", 2)])
def test_model_state_memory_follows_zero_formulas(spec, n):
    """fp32 parameters, fp32 gradients, two fp32 Adam states: 16 bytes a parameter, divided by the shards."""
    plan = plan_for(spec)
    n_params = sum(p.numel() for p in tiny_model().parameters())
    report(
        f"{spec} model states",
        plan.memory["parameters"] + plan.memory["gradients"] + plan.memory["optimizer"],
        16 * n_params // n,
    )


def test_tensor_parallel_memory_shards_all_but_norms():
    plan = plan_for("tp=4")
    model = tiny_model()
    norms = param_bytes(model, lambda name: "norm" in name)
    report("tp=4 parameter bytes", plan.memory["parameters"], (param_bytes(model) - norms) // 4 + norms)


def test_explain_answers_8b_on_64_ranks_without_processes():
    from models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("8b"))
    plan = spmd.explain(
        model, spmd.Rules.default(sequence_parallel=True), {"fsdp": 8, "tp": 8}, batch_shape=(8, 4096), dtype="bf16"
    )
    n_params = LlamaConfig.preset("8b").num_params()
    # every weight matrix is sharded 64 ways; only the norms stay whole over tp
    assert plan.memory["parameters"] < 4 * n_params / 64 * 1.01
    assert {c.axes for c in plan.collectives} == {("fsdp",), ("tp",)}
    assert "layers.*.attention.wq" in plan.table()
    assert not [c for c in plan.collectives if c.origin == "implicit"]


def test_pipeline_stages_gather_and_reduce_in_buckets():
    """pp=2,fsdp=2, 1F1B over 2 micro-batches: the last stage (the rank explain plans) holds block 1, the final
    norm and the output. Each micro-batch's forward gathers the block in one all-gather; the step's block
    gradients (reduced in the last backward) leave in one reduce-scatter, not one per parameter. The norm and
    the output move one by one and are regathered in backward, not kept from forward (a copy per micro-batch)."""
    plan = plan_for("pp=2,fsdp=2")
    model = tiny_model()
    block = param_bytes(model, lambda n: n.startswith("layers.1."))
    gathers = planned(plan, "all_gather", "fsdp", "forward", module=r"layers\.1")
    report("pp stage block all-gathers (one per micro-batch)", len(gathers), 2)
    rs = planned(plan, "reduce_scatter", "fsdp", "backward", module=r"layers\.1")
    report("pp stage block gradient reduce-scatters", len(rs), 1)
    report("pp stage block gradient bytes", rs[0].bytes, block // 2)
    for name in ("norm", "output"):
        report(f"pp stage {name} regathers", len(planned(plan, "all_gather", "fsdp", "backward", module=name)), 2)
