"""Context parallelism (a `cp` mesh axis, ring attention) against one process.

Four gloo processes, fp32, fixed seeds, one launch for every check. Ring attention: each rank's output and
the gradients of its q, k and v equal `F.scaled_dot_product_attention` on the whole sequence (causal and
full masks, grouped K/V heads) within 1e-5. Training: the tiny Llama on `cp=4`, `fsdp=2,cp=2`,
`cp=2,tp=2,sp` and `pp=2,cp=2` (1F1B, 2 micro-batches), and transformers' LlamaForCausalLM (SDPA, grouped
K/V, unchanged, as `--model hf:DIR` wraps it) and MixtralForCausalLM (its load-balancing loss included) on
`fsdp=2,cp=2`, each rank fed its zigzag share of the sequence
with the matching RoPE positions and targets: loss, every gradient and every parameter after each of 2 AdamW
steps equal one process within 1e-5 (||a-b|| / ||b|| per tensor, as in tests/test_spmd_numerics.py); the second
step's gradients, taken at the updated parameters, and its update, reading Adam's stored moments, prove what a
third step did. A sequence length that is not a multiple of 2*cp is an error naming the fix, raised before any
collective; so is a model that makes its own positions (a RoPE table sliced to the length, position ids or
learned positions from `arange`), which would pair the zigzag tokens with natural-order positions.

Ring traffic, measured on the real tensors sent in one step of `fsdp=2,cp=2` (both Llamas): per layer, forward (cp-1)
hops of this rank's K and V (kv_heads, not the repeated query heads), backward twice that (K/V again, and
dK/dV); equal to the formula and to `spmd.explain`'s plan. Load balance: under a causal mask the zigzag
split gives every rank the same attention work; a contiguous split gives the last rank about 2cp-1 times
the first's.
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import spmd
from spmd.analysis.record import CollectiveRecorder
from spmd.layout.sequence import cp_slice, zigzag_positions
from spmd.runtime.activations import attention_memory
from spmd.runtime.context_parallel.ring import ring_attention
from tests.dist_utils import run_distributed
from tests.measured import saved_bytes
from tests.spmd_cases import BATCH, SEQ, global_batch, local_slice, norm_rel_err, norm_rel_errs, plan_for, tiny_model

TOL = 1e-5
# measured memory against the plan, which is cp rank 0's: a rank that sees earlier ranks' blocks through their
# first chunk holds at its peak one half-chunk of dQ/dK more than rank 0 (6% of the tiny model's peak)
ACT_TOL = 0.10
TRAIN_SPECS = ["cp=4", "fsdp=2,cp=2", "cp=2,tp=2,sp", "pp=2,cp=2"]
MEASURED = "fsdp=2,cp=2"


def ring_bytes_formula(spec: str, n_layers: int, kv_heads: int, head_dim: int) -> dict:
    """Bytes one rank sends around the cp ring in a step on the test batch: per layer, cp-1 hops of its
    K and V blocks (batch / (dp*fsdp), seq / cp, kv_heads / tp, head_dim, fp32) forward, twice that backward."""
    sizes, _ = spmd.parse_spec(spec)
    cp, dp = sizes.get("cp", 1), sizes.get("dp", 1) * sizes.get("fsdp", 1)
    kv_block = 2 * (BATCH // dp) * (SEQ // cp) * (kv_heads // sizes.get("tp", 1)) * head_dim * 4
    forward = n_layers * (cp - 1) * kv_block
    return {"forward": forward, "backward": 2 * forward}


def _ring_sends(records) -> dict:
    return {
        phase: sum(c.bytes for c in records if c.kind == "send" and c.phase == phase and "ring" in c.reason)
        for phase in ("forward", "backward")
    }


def _check_ring_attention(causal: bool):
    mesh = spmd.make_mesh({"cp": 4})
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(2, h, 24, 8, generator=g, dtype=torch.float64).float().requires_grad_() for h in (4, 2, 2)
    )  # 4 query heads share 2 K/V heads
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    local = [cp_slice(t.detach(), mesh, dim=2).requires_grad_() for t in (q, k, v)]
    dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in local)
    out = ring_attention(dq, dk, dv, is_causal=causal, enable_gqa=True)
    out.to_local().backward(cp_slice(grad, mesh, dim=2))
    mask = "causal" if causal else "full"
    assert norm_rel_err(out.to_local(), cp_slice(ref.detach(), mesh, dim=2)) <= TOL, f"{mask}: output"
    for name, t, full in zip("qkv", local, (q, k, v)):
        err = norm_rel_err(t.grad, cp_slice(full.grad, mesh, dim=2))
        assert err <= TOL, f"{mask}: gradient of {name} off by {err:.2e}"


def _cp_batch(step: int, mesh):
    """This rank's tokens, targets and positions: its data-parallel rows, its zigzag share of the sequence."""
    tokens, targets = global_batch(step)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return tuple(cp_slice(local_slice(t, mesh), mesh) for t in (tokens, targets, positions))


def _hf_llama_dir(path) -> str:
    """config.json of a tiny transformers LlamaForCausalLM (grouped K/V heads, SDPA), as `--model hf:DIR` reads it."""
    transformers = pytest.importorskip("transformers")
    from tests.test_any_model import _TINY

    transformers.LlamaConfig(**{**_TINY, "vocab_size": 512, "num_key_value_heads": 2}).save_pretrained(path)
    return str(path)


def _hf_mixtral_dir(path) -> str:
    """config.json of a tiny transformers MixtralForCausalLM with its load-balancing loss: its MoE layers
    flatten batch and sequence into one dim of tokens (spmd.runtime.activations.global_view gathers the sequence for it
    and splits it again on the way back)."""
    transformers = pytest.importorskip("transformers")
    from tests.test_any_model import _TINY

    transformers.MixtralConfig(
        **{
            **_TINY,
            "vocab_size": 512,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
        }
    ).save_pretrained(path)
    return str(path)


def _hf_llama(hf_dir: str):
    """transformers' Llama, unchanged, as the trainer builds it for `--model hf:DIR` (models/transformers_lm.py)."""
    import models

    torch.manual_seed(0)
    model = models.preset(f"hf:{hf_dir}").build()
    assert model.config._attn_implementation == "sdpa"
    return model


def _layout(spec: str, build):
    """(model or pipeline, step(tokens, targets, positions) -> loss with gradients) for this spec."""
    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    rules = spmd.Rules.default(sequence_parallel="sp" in flags)
    if "pp" in sizes:
        pipe = spmd.build_pipeline(build(), mesh, rules, schedule="1f1b", microbatches=2)
        return pipe, pipe.stage_mesh, lambda x, y, pos: pipe.step(x, y, positions=pos)
    model = spmd.parallelize(build(), mesh, rules)

    def step(x, y, pos):
        loss = model(x, y, pos)
        loss.backward()
        return loss

    return model, mesh, step


def _train_and_compare(spec: str, planned=None, build=tiny_model):
    model, mesh, train_step = _layout(spec, build)
    ref = build()
    # eps above the roundoff of the smallest gradients, which Adam would otherwise blow up to steps of size lr
    # (as in tests/test_any_model.py)
    # (fused, the trainer's: on DTensor parameters it updates the local shards)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6, fused=True)
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        recorder = CollectiveRecorder(mesh) if planned and step == 0 else None
        with recorder or contextlib.nullcontext():
            loss = train_step(*_cp_batch(step, mesh))
        if recorder is not None:
            sent = _ring_sends(recorder.records)
            assert sent == planned, (spec, sent, planned)
        ref_loss = ref(*global_batch(step))
        assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (spec, step, loss, ref_loss)
        ref_loss.backward()
        grads = [(name, p.grad, ref_params[name].grad) for name, p in model.named_parameters()]
        for name, err in norm_rel_errs(grads).items():
            assert err <= TOL, f"{spec} step {step}: gradient of {name} off by {err:.2e}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        params = [(name, p, ref_params[name].detach()) for name, p in model.named_parameters()]
        for name, err in norm_rel_errs(params).items():
            assert err <= TOL, f"{spec} step {step}: parameter {name} off by {err:.2e}"


def _check_bad_length():
    mesh = spmd.make_mesh({"cp": 4})
    with pytest.raises(ValueError, match="multiple of 8"):
        cp_slice(torch.zeros(2, 12), mesh)
    q = DTensor.from_local(torch.zeros(1, 2, 3, 4), mesh, [Shard(2)], run_check=False)  # 12 tokens
    with pytest.raises(ValueError, match="multiple of 8"):
        ring_attention(q, q, q, is_causal=True)


def _check_natural_order_is_refused(hf_dir: str):
    """A model that makes its own positions under cp would pair zigzag tokens with natural-order positions:
    the tiny Llama called without `positions` (its RoPE table sliced to the length), transformers' Llama
    without them (position ids from `arange`) and a nanoGPT (learned positions from `arange`) all raise,
    naming the fix, instead of training wrong."""
    from tests.nanogpt import GPT, GPTConfig
    from tests.test_any_model import NANOGPT

    mesh = spmd.make_mesh({"cp": 4})
    llama = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default())
    tokens, targets, _ = _cp_batch(0, mesh)
    with pytest.raises(ValueError, match="natural order.*positions"):
        llama(tokens, targets)
    hf = spmd.parallelize(_hf_llama(hf_dir), mesh, spmd.Rules.default())
    with pytest.raises(ValueError, match="natural order.*positions"):
        hf(tokens, targets)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=256))
    spmd.annotate_by_name(gpt, NANOGPT)
    spmd.parallelize(gpt, mesh, spmd.Rules.default())
    with pytest.raises(ValueError, match="natural order.*positions"):
        gpt(tokens % 256, targets % 256)


def _check_memory_matches_plan(planned: dict):
    """On a real fsdp=2,cp=2 step of the tiny Llama: the bytes autograd keeps for backward (tests/measured.py),
    attention's part of them, and the peak one attention call holds (the ring's blocks and scores) equal
    explain's plan within ACT_TOL (activations and attention's part to the byte), so its figures for larger
    models and cp (benchmarks/context_parallel.py) can be trusted."""
    model, mesh, _ = _layout(MEASURED, tiny_model)
    record = {}
    with attention_memory.observe(record):
        with saved_bytes(model) as saved:
            loss = model(*_cp_batch(0, mesh))
        loss.backward()
    measured = {"activations": saved["activations"], "attention": saved["attention"], "peak": record["peak"]}
    for key, got in measured.items():
        assert abs(got - planned[key]) <= ACT_TOL * planned[key], f"{key}: measured {got:,} B, plan {planned[key]:,} B"


def _all_checks(rank, world, planned, hf_dir, hf_planned, planned_memory, moe_dir):
    _check_bad_length()
    _check_memory_matches_plan(planned_memory)
    _check_natural_order_is_refused(hf_dir)
    for causal in (True, False):
        _check_ring_attention(causal)
    for spec in TRAIN_SPECS:
        _train_and_compare(spec, planned if spec == MEASURED else None)
    _train_and_compare(MEASURED, hf_planned, build=functools.partial(_hf_llama, hf_dir))
    _train_and_compare(MEASURED, build=functools.partial(_hf_llama, moe_dir))


@pytest.mark.slow
def test_context_parallel_matches_one_process_and_its_plan(tmp_path):
    """The tiny Llama on every spec, transformers' Llama and Mixtral on fsdp=2,cp=2; the ring bytes of both
    Llamas, planned by explain, equal the formula (and in the launch, the bytes of a real step)."""
    cfg = tiny_model().cfg
    plan = plan_for(MEASURED)
    planned = _ring_sends(plan.collectives)
    planned_memory = {
        "activations": plan.memory["activations"],
        "attention": plan.attention["saved"],
        "peak": plan.attention["peak"],
    }
    assert planned == ring_bytes_formula(MEASURED, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), planned
    hf_dir = _hf_llama_dir(tmp_path / "hf")
    hf_model = _hf_llama(hf_dir)
    hf = hf_model.config
    hf_plan = spmd.explain(hf_model, spmd.Rules.default(), spmd.parse_spec(MEASURED)[0], batch_shape=(BATCH, SEQ))
    hf_planned = _ring_sends(hf_plan.collectives)
    assert hf_planned == ring_bytes_formula(
        MEASURED, hf.num_hidden_layers, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads
    ), hf_planned
    run_distributed(
        _all_checks, 4, planned, hf_dir, hf_planned, planned_memory, _hf_mixtral_dir(tmp_path / "moe"), timeout_s=300
    )


def _causal_pairs(positions: torch.Tensor) -> int:
    """(query, key) pairs a causal mask keeps for these query positions: the attention work they need."""
    return int((positions + 1).sum())


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_split_balances_causal_attention(cp):
    seq = 1024
    zigzag = [_causal_pairs(zigzag_positions(seq, cp, r)) for r in range(cp)]
    mean = sum(zigzag) / cp
    assert max(abs(w - mean) for w in zigzag) <= 0.05 * mean, zigzag  # in fact equal: 0%
    contiguous = [_causal_pairs(torch.arange(seq).chunk(cp)[r]) for r in range(cp)]
    assert contiguous[-1] / contiguous[0] == pytest.approx(2 * cp - 1, rel=0.02), contiguous


def test_zigzag_positions_cover_the_sequence_once():
    for cp in (1, 2, 4):
        shares = [zigzag_positions(16, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat(shares).sort().values, torch.arange(16))
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]


def test_explain_shows_attention_memory_and_refuses_a_length_that_does_not_split():
    """explain's table has attention's own line: its saved bytes, the peak of one call and the ring's sends per
    layer (the formula over the layers); a sequence that does not split into 2*cp chunks is an error naming
    the fix, as in the trainer's config check, spmd.cp_slice and the ring."""
    cfg, plan = tiny_model().cfg, plan_for(MEASURED)
    per_layer = {
        ph: b // cfg.n_layers
        for ph, b in ring_bytes_formula(MEASURED, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim).items()
    }
    assert plan.ring_sends_per_layer() == per_layer
    assert 0 < plan.attention["saved"] < plan.memory["activations"] and plan.attention["peak"] > 0
    line = plan.table().splitlines()[-1]
    assert (
        line.startswith("attention per rank: saved for backward")
        and f"ring sends per layer: forward {per_layer['forward']:,} B, backward {per_layer['backward']:,} B" in line
    )
    with pytest.raises(ValueError, match=r"sequence length 12 does not split over cp=4.*multiple of 8"):
        spmd.explain(tiny_model(), spmd.Rules.default(), {"cp": 4}, batch_shape=(2, 12))
