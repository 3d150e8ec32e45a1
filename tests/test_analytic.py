"""benchmarks/analytic.py against the formulas of shared/DESIGN.md on simple cases, and against spmd.explain
on the tiny model (fake worlds): bytes per rank per step, collective counts and model-state bytes, ratio 1.

Each comparison prints explain/analytic; where a formula applies the assertion demands exactly 1.
"""

import pytest
import torch

import models
import spmd
from benchmarks import analytic as A
from models.llama import Llama, LlamaConfig

B, T = 8, 16
SPECS = [
    "dp=4",
    "fsdp=4",
    "dp=2,fsdp=2",
    "tp=4",
    "tp=4,sp",
    "fsdp=2,tp=2",
    "fsdp=2,tp=2,sp",
    "dp=2,tp=2,sp",
    "dp=2,fsdp=2,tp=2,sp",
]


def tiny(**overrides):
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny", kernels="torch", **overrides))


def plan_for(model, spec, dtype="fp32"):
    sizes, flags = spmd.parse_spec(spec)
    return spmd.explain(
        model, spmd.Rules.default(sequence_parallel="sp" in flags), sizes, batch_shape=(B, T), dtype=dtype
    )


def ratio(name, got, want):
    print(f"{name}: explain {got:,} analytic {want:,} ratio {got / want:.6f}")
    return got / want


# ------------------------------------------------------------------ the analytic model against the formulas
def test_megatron_tp_is_8bsh_per_block_plus_embedding_and_output():
    cfg = LlamaConfig.preset("small")
    t, e = 4, 2
    m = A.comm(cfg, "tp=4", 8, 64, "bf16")
    S = 8 * 64 * cfg.dim * e
    terms = {x.name: x for x in m.terms}
    assert terms["TP blocks (Megatron)"].bytes == cfg.n_layers * 8 * S * (t - 1) // t
    assert terms["TP blocks (Megatron)"].count == 4 * cfg.n_layers
    assert terms["TP embedding + output"].bytes == 4 * S * (t - 1) // t
    sp = {x.name: x for x in A.comm(cfg, "tp=4,sp", 8, 64, "bf16").terms}
    assert sp["TP blocks (Megatron, SP)"].bytes == terms["TP blocks (Megatron)"].bytes  # same bytes
    assert sp["TP blocks (Megatron, SP)"].count == 2 * terms["TP blocks (Megatron)"].count
    assert A.textbook_comm(cfg, "tp=4", 8, 64, "bf16")["tp"] == terms["TP blocks (Megatron)"].bytes


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero3_moves_three_psi_and_dp_two_psi(n):
    cfg = LlamaConfig.preset("small")
    psi = cfg.num_params() * 4
    root = (2 * cfg.vocab_size * cfg.dim + cfg.dim) * 4  # embedding, output, final norm: gathered once (FSDP2's root)
    fsdp = A.comm(cfg, f"fsdp={n}", 8 * n, 32)
    assert fsdp.total(textbook_only=True) == 3 * psi * (n - 1) // n
    loss = 2 * 8 * (n - 1) // n
    assert fsdp.total() == 3 * psi * (n - 1) // n - root * (n - 1) // n + loss
    dp = A.comm(cfg, f"dp={n}", 8 * n, 32)
    assert dp.total(textbook_only=True) == 2 * psi * (n - 1) // n
    # mixed precision: gathers in bf16, the reduce-scatter in fp32
    assert A.comm(cfg, f"fsdp={n}", 8 * n, 32, "bf16").total(textbook_only=True) == (2 * psi // 2 + psi) * (n - 1) // n


def test_zero_model_state_formulas():
    psi, n = 1000, 8
    assert A.zero_model_states(psi, n, 0) == 16 * psi
    assert A.zero_model_states(psi, n, 1) == 4 * psi + 12 * psi / n
    assert A.zero_model_states(psi, n, 2) == 2 * psi + 14 * psi / n
    assert A.zero_model_states(psi, n, 3) == 16 * psi / n
    assert A.zero_model_states(psi, n, 0, mixed_precision=False) == 16 * psi
    assert A.zero_model_states(psi, n, 3, mixed_precision=False) == 16 * psi / n


def test_model_states_follow_zero3_for_fsdp_and_dp_for_dp():
    cfg = LlamaConfig.preset("small")
    psi = cfg.num_params()
    assert A.model_states(cfg, "fsdp=4")["total"] == A.zero_model_states(psi, 4, 3)
    assert A.model_states(cfg, "dp=4")["total"] == A.zero_model_states(psi, 4, 0)
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    assert A.model_states(cfg, "tp=4")["parameters"] == 4 * ((psi - norms) // 4 + norms)


def test_bad_specs_are_errors():
    with pytest.raises(ValueError, match="divide"):
        A.comm(LlamaConfig.preset("tiny"), "fsdp=3", 8, 16)
    with pytest.raises(ValueError, match="unknown"):
        A.Spec.parse("fdsp=2")


# ------------------------------------------------------------------ the analytic model against explain
BF16_SPECS = [
    "fsdp=4",
    "dp=2,fsdp=2",
    "tp=4,sp",
    "fsdp=2,tp=2,sp",
]  # gathers and TP/SP activations in the compute dtype


@pytest.mark.parametrize("spec, dtype", [(s, "fp32") for s in SPECS] + [(s, "bf16") for s in BF16_SPECS])
def test_explain_matches_analytic_on_the_tiny_model(spec, dtype):
    model = tiny()
    plan = plan_for(model, spec, dtype)
    m = A.comm(model.cfg, spec, B, T, dtype)
    assert ratio(f"{spec} {dtype} total bytes", plan.comm_bytes(), m.total()) == 1
    got_axes = {}
    for c in plan.collectives:
        got_axes["+".join(c.axes)] = got_axes.get("+".join(c.axes), 0) + c.bytes
    assert got_axes == m.by_axis()
    assert len(plan.collectives) == m.count()
    states = sum(plan.memory[k] for k in ("parameters", "gradients", "optimizer"))
    assert ratio(f"{spec} model states", states, A.model_states(model.cfg, spec)["total"]) == 1
    assert not [c for c in plan.collectives if c.origin == "implicit"]


def test_tied_embeddings_are_regathered_for_the_output_under_fsdp():
    model = tiny(tie_embeddings=True)
    plan = plan_for(model, "fsdp=2")
    m = A.comm(model.cfg, "fsdp=2", B, T)
    tied = model.cfg.vocab_size * model.cfg.dim * 4
    excess = plan.comm_bytes() - m.total()
    print(f"tied fsdp=2: explain - analytic = {excess:,} B = {excess / (tied // 2):.2f} x the tied weight's ring bytes")
    assert plan.comm_bytes() == m.total()


# ------------------------------------------------------------------ a mixture of experts under ep
@pytest.mark.parametrize("spec", ["fsdp=2,ep=4", "dp=2,ep=2,tp=2"])
def test_expert_traffic_and_memory_match_explain_at_balanced_routing(spec):
    """explain's all-to-alls (dispatch, combine, their backward, the token counts) and the router statistics'
    all-reduces, per mesh axis, and the expert parameters per rank equal expert_comm / expert_states."""
    torch.manual_seed(0)
    cfg = models.preset("moe-tiny", kernels="torch")
    plan = plan_for(cfg.build(), spec)
    got: dict = {}
    for c in plan.collectives:
        if c.kind == "all_to_all" or (c.kind == "all_reduce" and c.module.endswith("feed_forward")):
            count, nbytes = got.get("+".join(c.axes), (0, 0))
            got["+".join(c.axes)] = (count + 1, nbytes + c.bytes)
    m = A.expert_comm(cfg, spec, B, T)
    want = {axis: (sum(t.count for t in m.terms if t.axis == axis), nbytes) for axis, nbytes in m.by_axis().items()}
    assert got == want
    ep = A.Spec.parse(spec).ep
    dispatch = [t for t in m.terms if t.textbook]  # DESIGN.md: 4 per layer of top_k*b*s*h*e (ep-1)/ep
    assert (
        sum(t.bytes for t in dispatch)
        == 4 * cfg.n_layers * cfg.top_k * B // (A.Spec.parse(spec).data_parallel) * T * cfg.dim * 4 * (ep - 1) // ep
    )
    assert ratio(f"{spec} expert parameters", plan.memory["expert_parameters"], A.expert_states(cfg, spec)) == 1
