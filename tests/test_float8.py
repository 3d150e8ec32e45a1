"""float8 training (spmd.float8_training: torchao's Float8Linear, tensorwise dynamic scales, emulated on CPU) laid
out by spmd trains as the same float8 model does in one process on the full batch.

One launch of four gloo processes holds every case. On `fsdp=4`, `dp=2,fsdp=2` and `fsdp=2,tp=2,sp`, 2 AdamW
steps of the tiny Llama with every block linear in float8 (the output head stays fp32): the scale of every
float8 cast (inputs, weights, output gradients; forward and backward) equals the one-process scale within
SCALE_TOL, the loss within LOSS_TOL, gradients and updated parameters (||a-b|| / ||b||) within TOL.

The scales are the sharp check. A scale is max|x| over the whole tensor; taken over this rank's slice of the
batch (a block running on local tensors) or over a tp shard of a weight, it is off by tens of percent, not by
rounding. The two runs cast operands that differ only by fp32 summation order (~1e-7 relative), and a max
differs by as much: SCALE_TOL = 1e-5 (measured: 0 on dp/fsdp, 4.4e-7 on tp; with local scales 0.49 on inputs,
0.74 on output gradients).

LOSS_TOL = 1e-5 as for fp32 (measured 1.5e-7). TOL = 3e-3, where the fp32 specs hold 1e-5
(tests/test_spmd_numerics.py): two operands 1e-7 apart round to neighbouring float8 values when one sits on a
rounding boundary (chance ~1e-7 / 2^-3 per element per cast), which moves that element by one float8 step
(1/8 of it in e4m3, 1/4 in e5m2). One such flip in a weight-gradient matmul over T tokens and K features moves
that gradient by about (1/8) / sqrt(T K) = 1.4e-3 of its norm (T = 128, K = 64); TOL allows two. Measured: at
most 1.0e-4 on gradients (tp: another summation order), 1.7e-5 on parameters on an Intel CPU. Over tp the
gradients are summed in another order than one process's (partial sums of each shard, then the all-reduce):
on an AMD EPYC wk's gradient at step 1 on fsdp=2,tp=2,sp is 1.03e-2 off, so tp specs hold TP_TOL = 2e-2.
With local scales every element re-rounds: gradients 0.15 off, parameters 0.047, the loss 2.0e-4.

The same launch gathers the weights in float8 (`comm={"params": "float8"}`) on `fsdp=4` and `fsdp=2,tp=2,sp`
and holds the run to the same one-process model and tolerances: the codes that travel are the ones the layer's
own cast would make. And one bf16 step on fsdp=4: each block's gather moves (n-1)(bf16 bytes/(n-1) - float8
weight values per rank) bytes, the float8 weights at one byte per value. Kills: the scales' max all-reduce left
out (each rank scales its shard by its own max: scales off by 8%); the weights gathered at full precision.

Kills (tests/mutants.py): blocks holding float8 layers run on local tensors (the `computes_in_float8` check in
spmd/runtime/local/blocks.py removed), so activation scales are per-rank maxima: fails on fsdp=4.
"""

import sys
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import spmd
from spmd.analysis.record import CollectiveRecorder
from spmd.float8 import computes_in_float8, float8_layers
from spmd.runtime.state import STATE_ATTR
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, local_slice, norm_rel_err, tiny_model

TOL, TP_TOL, LOSS_TOL, SCALE_TOL = 3e-3, 2e-2, 1e-5, 1e-5
SPECS = ["fsdp=4", "dp=2,fsdp=2", "fsdp=2,tp=2,sp"]
WIRE_SPECS = ["fsdp=4", "fsdp=2,tp=2,sp"]
CASTS_PER_LAYER = 6  # forward: input, weight; backward: output gradient twice, weight, input


def _float8_tiny():
    return spmd.float8_training(tiny_model(), emulate=True)


@contextmanager
def _scales():
    """{gemm role: [scale of each float8 cast]} of the casts torchao's Float8Linear makes inside."""
    from torchao.float8 import float8_linear

    original, seen = float8_linear.hp_tensor_to_float8_dynamic, {}

    def recording(hp, *args, **kwargs):
        out = original(hp, *args, **kwargs)
        local = out._local_tensor if isinstance(out, DTensor) else out
        seen.setdefault(str(kwargs["gemm_input_role"]), []).append(local._scale.item())
        return out

    float8_linear.hp_tensor_to_float8_dynamic = recording
    try:
        yield seen
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = original


def _check_scales(spec, step, got, want, layers):
    assert sum(map(len, got.values())) == CASTS_PER_LAYER * layers, (spec, {k: len(v) for k, v in got.items()})
    for role, scales in want.items():
        # the backward may visit sibling layers (wq, wk, wv) in another order: scales compared as sorted lists
        err = max(abs(a - b) / b for a, b in zip(sorted(got[role]), sorted(scales)))
        assert err <= SCALE_TOL, f"{spec} step {step}: {role} scales off by {err:.2e} (a max over a shard?)"


def _check_values(spec, step, what, model, ref, grads):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        got, want = (p.grad, ref_params[name].grad) if grads else (p, ref_params[name].detach())
        err = norm_rel_err(got.full_tensor(), want)
        tol = TP_TOL if "tp" in spec else TOL
        assert err <= tol, f"{spec} step {step}: {what} of {name} off by {err:.2e}"


def _step(model, ref, mesh, step):
    tokens, targets = global_batch(step)
    with _scales() as got:
        loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
        loss.backward()
    with _scales() as want:
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
    return loss.item(), ref_loss.item(), got, want


def _compare(spec, comm=None):
    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    ref, model = _float8_tiny(), _float8_tiny()
    layers = len(float8_layers(model))
    assert layers == 14 and "output" not in float8_layers(model)
    spmd.parallelize(model, mesh, spmd.Rules.default(sequence_parallel="sp" in flags), comm=comm)
    local = getattr(model, STATE_ATTR).local_members
    assert not [n for n, m in model.named_modules() if id(m) in local and float8_layers(m)], spec
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (model, ref))
    for step in range(2):
        loss, ref_loss, got, want = _step(model, ref, mesh, step)
        if step == 0 and "tp" in spec:  # the pass moved their inputs as a linear layer's (activations.moves)
            decided = {name for name, _ in getattr(model, STATE_ATTR).decisions}
            assert {"layers.0.attention.wq", "layers.0.feed_forward.w1"} <= decided, decided
        _check_scales(spec, step, got, want, layers)
        assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), (spec, step, loss, ref_loss)
        _check_values(spec, step, "gradient", model, ref, grads=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _check_values(spec, step, "parameter", model, ref, grads=False)
    with pytest.raises(ValueError, match="before spmd.parallelize"):
        spmd.float8_training(model, emulate=True)


def _gather_bytes(comm) -> list:
    """(module, bytes) of each all-gather in one bf16 step of the float8 tiny model on fsdp=4."""
    mesh = spmd.make_mesh({"fsdp": 4})
    model = spmd.parallelize(_float8_tiny(), mesh, spmd.Rules.default(), param_dtype=torch.bfloat16, comm=comm)
    tokens, targets = global_batch(0)
    with CollectiveRecorder(mesh) as rec:
        model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
    return [(c.module, c.bytes) for c in rec.records if c.kind == "all_gather"], model


def _float8_gathers_move_a_byte_per_weight_value():
    """Each block's gather moves its float8 weights at 1 byte per value where bf16 moves 2, the rest as bf16:
    bf16 bytes - (n - 1) * (float8 weight values per rank), gather by gather."""
    n = 4
    plain, _ = _gather_bytes(None)
    wire, model = _gather_bytes({"params": "float8"})
    blocks = dict(model.named_modules())
    assert [m for m, _ in wire] == [m for m, _ in plain], (wire, plain)
    for (module, full), (_, got) in zip(plain, wire):
        block = blocks.get(module)  # None: the root unit (embedding, norm, output head: no float8 layer)
        f8 = 0 if block is None else sum(m.weight.numel() for m in block.modules() if computes_in_float8(m))
        assert got == full - (n - 1) * f8 // n, (module, got, full, f8)
        assert block is None or got <= 0.51 * full, (module, got, full)  # a block is its float8 weights, nearly


def _every_spec(rank, world):
    for spec in SPECS:
        _compare(spec)
    for spec in WIRE_SPECS:  # the weights gather in float8, cast with the one-device scale
        _compare(spec, {"params": "float8"})
    _float8_gathers_move_a_byte_per_weight_value()


@pytest.mark.slow
def test_float8_specs_match_one_process():
    run_distributed(_every_spec, 4, timeout_s=300)


def test_float8_refuses_what_it_cannot_convert(monkeypatch):
    """A model without an eligible linear layer, one converted already, and a missing torchao are errors naming
    the fix."""
    with pytest.raises(ValueError, match="no linear layer to compute in float8.*divide by 16"):
        spmd.float8_training(nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 3)))
    with pytest.raises(ValueError, match="output is skipped"):
        spmd.float8_training(nn.ModuleDict({"output": nn.Linear(32, 32)}))
    with pytest.raises(ValueError, match="already computes in float8 .14 layers"):
        spmd.float8_training(_float8_tiny())
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match="pip install torchao"):
        spmd.float8_training(tiny_model())


def _train(monkeypatch, *flags):
    import launch.train as T
    from launch.config import load_config

    monkeypatch.setattr(T, "peak_flops", lambda dtype, device: (1e11, "test"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return T.train(load_config(["--batch-size", "8", "--seq-len", "64", "--steps", "3", *flags]), log=False)


def test_trainer_float8_flag_toml_and_explain(monkeypatch, tmp_path):
    """`launch.train --float8` (and `float8 = true` in TOML) trains the float8 model: its losses move off fp32's
    by float8 rounding (more than 1e-5, less than 0.05); explain notes the float8 layers and plans their max
    all-reduces; without torchao the config check names the fix."""
    from launch.config import load_config

    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "cache"))
    fp32, float8 = _train(monkeypatch), _train(monkeypatch, "--float8")
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(fp32, float8)]
    assert min(gaps) > 1e-5 and max(gaps) < 0.05, gaps
    (tmp_path / "f8.toml").write_text("float8 = true\n")
    assert load_config(["--config", str(tmp_path / "f8.toml")]).float8
    plan = spmd.explain(_float8_tiny(), spmd.Rules.default(), {"fsdp": 2}, batch_shape=(4, 16))
    assert plan.notes and plan.notes[0].startswith("14 of 15 linear layers compute in float8"), plan.notes
    assert "note: 14 of 15" in plan.table() and plan.to_dict()["notes"] == plan.notes
    maxima = [c for c in plan.collectives if c.kind == "all_reduce" and "Partial(max)" in c.reason]
    assert len(maxima) == 4 * 14, len(maxima)  # per layer: the input forward; output gradient x2, input backward
    assert not spmd.explain(tiny_model(), spmd.Rules.default(), {"fsdp": 2}, batch_shape=(4, 16)).notes
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError, match="--float8 needs torchao.*pip install torchao"):
        load_config(["--float8"]).validate(1)


def test_float8_benchmark_smoke_on_cpu_and_refusal_without_cuda(tmp_path, capsys):
    """benchmarks/float8.py's code path on CPU (tiny, emulated, eager): both variants timed, the ratio and the
    report written; without --cpu-smoke and without CUDA it stops with exit code 2 and says why."""
    import json

    from benchmarks import float8 as bench

    if not torch.cuda.is_available():
        assert bench.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    (report,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-float8-tiny.json")]
    res = report["results"]
    assert set(res["variants"]) == {"bf16", "float8"} and res["float8_layers"] == "14 of 15"
    assert res["float8_over_bf16_tokens_per_s"]["rounds"] == 2 and report["environment"]["commit"]
    assert all(v["tokens_per_s_median"] > 0 for v in res["variants"].values())
