"""The quantized wire in one process: every block's quantize-dequantize error within its format's bound,
bytes = payload + scales, the `comm` setting refused with a clear error before anything moves, and explain's
plan counting quantized bytes and the packed buffers' memory.

Bounds: int8 rounds to the nearest code, so per block max |x - q(x)| <= scale/2 (scale = block absmax /
127); int4 rounds stochastically to one of the two codes around a value, |x - q(x)| < scale (absmax / 7),
and without bias: over values spread inside half a code step the mean error is a small fraction of a
step where nearest rounding's is a quarter; fp8 e4m3 rounds to 3 mantissa bits, |x - q(x)| <= 2^-4 |x| among
normal values and 2^-10 * scale among subnormal ones. Mutations that fail it (each tried): truncating
instead of rounding (`.round_()` -> `.trunc_()`) fails the int8 bound; rounding int4 to the nearest code
fails the unbiasedness; adding the draw without flooring (`.floor_()` -> `.round_()`) fails the int4 bound;
one scale per row instead of per block fails the per-block bound on rows of mixed magnitude.
"""

import math

import pytest
import torch

import spmd
from spmd.analysis.fake import fake_world
from spmd.runtime.wire import DEFAULT_BLOCK, dequantize, packed_bytes, quantize
from tests.spmd_cases import BATCH, SEQ, tiny_model


def _rows() -> torch.Tensor:
    """Rows whose blocks span nine orders of magnitude, a zero block, and a short last block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1000, generator=g) * torch.logspace(-4, 4, 1000).view(1, -1)
    x[1, :64] = 0
    return x


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("block", [2, 64, DEFAULT_BLOCK])
def test_every_block_is_within_its_format_bound(fmt, block):
    x = _rows()
    packed = quantize(x, fmt, block)
    assert packed.dtype == torch.uint8 and packed.shape == (4, packed_bytes(1000, fmt, block))
    y = dequantize(packed, 1000, fmt, block)
    for start in range(0, 1000, block):
        xb, yb = x[:, start : start + block], y[:, start : start + block]
        scale = xb.abs().amax(-1, keepdim=True) / {"int8": 127, "int4": 7, "fp8": 448}[fmt]
        err = (xb - yb).abs()
        if fmt == "fp8":
            bound = 2**-4 * xb.abs() + 2**-10 * scale
        else:
            bound = scale / 2 if fmt == "int8" else scale
        assert (err <= bound * (1 + 1e-5) + 1e-30).all(), (fmt, block, start, (err - bound).max())


def test_int4_rounds_without_bias():
    """Values spread over [0, 1/2) code step in blocks whose largest value is 7 steps: nearest rounding would
    drop every one to 0, -1/4 step on average; stochastic rounding moves them by ~0 on average."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 256, generator=g) / 2
    x[:, 0] = 7.0  # the block's largest value: a scale of exactly one per code
    err = dequantize(quantize(x, "int4", 256), 256, "int4", 256)[:, 1:] - x[:, 1:]
    assert err.abs().max() < 1.0
    assert abs(err.mean().item()) < 0.01, f"int4 rounding is biased by {err.mean().item():.4f} of a step"


def test_bytes_are_payload_plus_one_fp32_scale_per_block():
    assert packed_bytes(4096 * 3, "int8", 4096) == 4096 * 3 + 3 * 4
    assert packed_bytes(4096 * 3 + 1, "fp8", 4096) == 4096 * 3 + 1 + 4 * 4
    assert packed_bytes(1001, "int4", 64) == 501 + 4 * math.ceil(1001 / 64)


@pytest.mark.parametrize(
    "comm, named",
    [
        ({"params": "int4"}, "comm['params']='int4'"),
        ({"grads": "fp8"}, "comm['grads']='fp8'"),
        ({"block": 0}, "comm['block']=0"),
        ({"block": 33}, "comm['block']=33"),
        ({"hpz": "node"}, "comm['hpz']='node'"),
        ({"params": "float8"}, "call spmd.float8_training(model) before parallelize"),
        ({"param": "int8"}, "unknown keys ['param']"),
        ("int8", "must be a dict"),
    ],
)
def test_a_bad_comm_is_refused_before_anything_moves(comm, named):
    model = tiny_model()
    with fake_world({"fsdp": 4}) as (mesh, _):
        with pytest.raises(ValueError) as err:
            spmd.parallelize(model, mesh, spmd.Rules.default(), comm=comm)
    assert named in str(err.value)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_compiled_blocks_take_the_wire_only_where_their_hooks_stay_eager():
    """Blocks compiled after parallelize(comm=...), data-only or tp, checkpointed or not, with float8 layers on
    fsdp, compile (their groups gather on the wire around the graph; the 4-rank proofs are in
    tests/test_wire_four_ranks.py); float8 layers over tp, or blocks compiled before, which would move tensors
    inside the graph, are refused naming the fix."""
    comm = {"params": "int8"}
    with fake_world({"fsdp": 2, "tp": 2}) as (mesh, _):
        model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default(), comm=comm)
        assert spmd.compile_blocks(model, backend="eager") == [0, 1]
        float8 = spmd.parallelize(
            spmd.float8_training(tiny_model(), emulate=True), mesh, spmd.Rules.default(), comm=comm
        )
        with pytest.raises(ValueError, match="layers.0, layers.1 hold float8 layers laid out over tp.*drop tp"):
            spmd.compile_blocks(float8, backend="eager")
    with fake_world({"fsdp": 4}) as (mesh, _):
        model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default(), comm=comm)
        assert spmd.compile_blocks(model, backend="eager") == [0, 1]
        checkpointed = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default(), comm=comm)
        spmd.apply_activation_checkpointing(checkpointed, "full")
        assert spmd.compile_blocks(checkpointed, backend="eager") == [0, 1]
        float8 = spmd.parallelize(
            spmd.float8_training(tiny_model(), emulate=True), mesh, spmd.Rules.default(), comm=comm
        )
        assert spmd.compile_blocks(float8, backend="eager") == [0, 1]
        compiled_first = tiny_model()
        spmd.compile_blocks(compiled_first, backend="eager")
        with pytest.raises(ValueError, match="call compile_blocks after parallelize"):
            spmd.parallelize(compiled_first, mesh, spmd.Rules.default(), comm={"grads": "int4"})


def test_explain_counts_quantized_bytes_and_their_buffers():
    """The plan on fsdp=4: each int8 gather row is L + 4 ceil(L/B) bytes where bf16's is 2L, and the packed
    buffers of the largest quantized collective are in the memory table."""

    def plan(comm):
        return spmd.explain(
            tiny_model(), spmd.Rules.default(), {"fsdp": 4}, (BATCH, SEQ), dtype=torch.bfloat16, comm=comm
        )

    bf16, int8 = plan(None), plan({"params": "int8", "grads": "int8"})
    gathers = [c.bytes for c in bf16.collectives if c.kind == "all_gather"]
    quantized = [c for c in int8.collectives if c.kind == "all_gather"]
    assert [c.bytes for c in quantized] == [packed_bytes(b // 6, "int8", DEFAULT_BLOCK) * 3 for b in gathers]
    assert all("int8 on the wire" in c.reason for c in quantized)
    assert "wire" not in bf16.memory
    biggest = max(c.bytes for c in int8.collectives if "on the wire" in c.reason and c.kind == "all_to_all")
    assert int8.memory["wire"] >= 2 * biggest * 4 // 3 > 0
    assert int8.memory["total"] == bf16.memory["total"] + int8.memory["wire"]


def test_explain_counts_hpz_secondary_copies():
    """dp=2,fsdp=2 with parameters over both axes: hpZ keeps each parameter's fsdp shard (numel/2 fp32
    values) from forward to backward, and the plan's backward regathers stay inside fsdp."""
    shard = {"embed": ("dp", "fsdp")}
    rules = spmd.Rules(spmd.Rules.default().compute, params=shard, grads=shard, optimizer=shard)
    plan = spmd.explain(tiny_model(), rules, {"dp": 2, "fsdp": 2}, (BATCH, SEQ), comm={"hpz": "fsdp"})
    assert plan.memory["hpz"] == sum(p.numel() // 2 * 4 for p in tiny_model().parameters())
    regathers = [c for c in plan.collectives if c.kind == "all_gather" and c.phase == "backward"]
    assert regathers and all(c.axes == ("fsdp",) for c in regathers)


def test_trainer_flags_and_toml_set_comm(tmp_path):
    from launch.config import load_config

    cfg = load_config(["--comm-params", "int8", "--comm-grads", "int4", "--hpz", "fsdp", "--mesh", "dp=2,fsdp=2"])
    assert cfg.validate(4).comm() == {"params": "int8", "grads": "int4", "hpz": "fsdp"}
    f = tmp_path / "run.toml"
    f.write_text('comm_params = "fp8"\ncomm_grads = "int8"\n')
    assert load_config(["--config", str(f)]).validate(4).comm() == {"params": "fp8", "grads": "int8"}
    assert load_config([]).comm() is None
    tp = ["--comm-grads", "int8", "--compile", "--mesh", "fsdp=2,tp=2", "--sp"]
    assert load_config(tp).validate(4).comm() == {"grads": "int8"}


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--comm-params", "int4"], "--comm-params 'int4' is not supported; use int8, fp8 or float8"),
        (["--comm-params", "float8"], "--comm-params float8 gathers float8 layers' weights .* needs --float8"),
        (["--comm-grads", "fp8"], "--comm-grads 'fp8' is not supported; use int8 or int4"),
        (["--hpz", "dp"], "--hpz 'dp' is not an axis of --mesh fsdp=4 with more than one rank"),
        (["--comm-params", "int8", "--compile", "--mesh", "fsdp=2,cp=2"], "--compile and --mesh axis cp is not"),
        (["--comm-params", "int8", "--compile", "--float8", "--mesh", "fsdp=2,tp=2"], "--float8 over tp is not"),
    ],
)
def test_trainer_refuses_bad_comm_flags(flags, match):
    from launch.config import load_config

    with pytest.raises(ValueError, match=match):
        load_config(flags).validate(4)


def test_search_offers_compression_where_parameter_traffic_binds():
    from spmd.analysis.search_rows import Row, compression_note

    bound = Row("fsdp=8", {"fsdp": 8}, False, compute_s=1.0, activation_comm_s=0.1, param_comm_s=2.0)
    assert "--comm-params int8 --comm-grads int4" in compression_note(bound)
    for row in (
        Row("fsdp=8", {"fsdp": 8}, False, compute_s=3.0, activation_comm_s=0.1, param_comm_s=2.0),  # compute
        Row("tp=8", {"tp": 8}, False, compute_s=1.0, activation_comm_s=2.0, param_comm_s=0.0),  # activations
        Row("fsdp=8", {"fsdp": 8}, False, compute_s=1.0, activation_comm_s=0.1, param_comm_s=2.0, schedule="1f1b"),
    ):
        assert compression_note(row) == ""


def test_a_one_rank_mesh_and_size_one_axes_move_nothing():
    comm = {"params": "int8", "grads": "int4"}
    one = spmd.explain(tiny_model(), spmd.Rules.default(), {"fsdp": 1}, (BATCH, SEQ), comm=comm)
    assert one.collectives == [] and one.memory["wire"] == 0
    plan = spmd.explain(tiny_model(), spmd.Rules.default(), {"dp": 1, "fsdp": 4}, (BATCH, SEQ), comm=comm)
    assert plan.collectives and all(c.axes == ("fsdp",) for c in plan.collectives)
