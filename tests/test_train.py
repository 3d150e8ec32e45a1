"""launch.train end to end on CPU: the loss falls, resume is exact, accumulation and activation checkpointing
do not change the numbers, SIGTERM checkpoints and exits 0, and a 4-process run (ZeRO-2, and a resume of its
checkpoint in one process) matches the single-process run step by step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import launch.train as T
import spmd
from launch.config import load_config
from launch.data import DataLoader
from models.llama import Llama, LlamaConfig
from spmd import checkpoint
from tests.train_ranks import train_on_ranks

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--batch-size", "8", "--seq-len", "64", "--warmup", "3", "--lr", "3e-3"]


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def _train(*flags):
    return T.train(load_config(list(SMALL) + list(flags)), log=False)


def _env():
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    return env


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_loss_falls_and_metrics_rows(tmp_path):
    rows = _train("--steps", "12", "--metrics", str(tmp_path / "m.jsonl"))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    lines = _jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 13))
    assert all(
        tuple(r)
        == (
            "step",
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_s",
            "mfu",
            "step_time_s",
            "peak_mem_bytes",
            "comm_bytes",
            "skipped_steps",
        )
        for r in lines
    )
    assert lines[0]["lr"] == pytest.approx(1e-3) and lines[0]["comm_bytes"] == 0 and lines[0]["mfu"] > 0
    assert all(r["skipped_steps"] == 0 for r in lines)


def test_resume_is_exact(tmp_path):
    ck = tmp_path / "ck"
    straight = _train("--steps", "20", "--ckpt-dir", str(ck), "--ckpt-every", "10")
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-10", "step-20"]
    (ck / "latest").write_text("step-10\n")  # as if the run had stopped after step 10
    resumed = _train("--steps", "20", "--ckpt-dir", str(ck), "--resume")
    assert [r["step"] for r in resumed] == list(range(11, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[10:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[10:]]
    meta = checkpoint.read_meta(ck)
    assert meta["step"] == 20 and meta["data"]["step"] == 20 and meta["config"]["batch_size"] == 8


def test_grad_accumulation_matches_one_big_batch():
    one = _train("--steps", "3")
    four = _train("--steps", "3", "--grad-accum", "4")
    assert one[0]["loss"] == pytest.approx(four[0]["loss"], rel=1e-6)
    assert one[0]["grad_norm"] == pytest.approx(four[0]["grad_norm"], rel=1e-5)
    for a, b in zip(one[1:], four[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_compiled_blocks_track_eager(monkeypatch):
    """--compile with --ac selective:2 on the tiny model: block 0 checkpointed (its body compiled, the checkpoint
    outside), block 1 compiled whole; losses agree to 1e-5 and gradient norms to 1e-4. The trainer's blocks compile
    with backend aot_eager here (dynamo's capture and AOTAutograd's joint graph, the checkpoint outside them): the
    loop's --compile is what this test is about, and inductor's code generation on these blocks, with collectives
    and the same selective:2, is test_compile's inductor test (inductor here cost about 50 CPU-seconds). It also
    asserts that both blocks compiled and their graphs ran. Kills (tests/mutants.py): launch.train compiling no
    block under --compile, which passed when only the losses were compared."""
    graphs = []

    def recording_backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compile_blocks, compiled_blocks = spmd.compile_blocks, []

    def compile_blocks_recorded(model, *args, **kwargs):
        compiled_blocks.extend(compile_blocks(model, *args, backend=recording_backend, **kwargs))
        return compiled_blocks

    monkeypatch.setattr(spmd, "compile_blocks", compile_blocks_recorded)
    eager = _train("--steps", "3", "--ac", "selective:2")
    assert not graphs and not compiled_blocks
    compiled = _train("--steps", "3", "--ac", "selective:2", "--compile")
    assert compiled_blocks == [0, 1] and graphs, (compiled_blocks, len(graphs))  # (the two blocks share a graph)
    for a, b in zip(eager, compiled):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_low_precision_tracks_fp32():
    """bf16 and fp16 runs of 10 steps stay within 0.05 of the fp32 run's loss at every step; one
    test, so the fp32 run is trained once for both."""
    ref = _train("--steps", "10")
    for dtype in ("bf16", "fp16"):
        low = _train("--steps", "10", "--dtype", dtype)
        assert len(low) == len(ref) == 10, (dtype, len(low), len(ref))
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, low)) < 0.05, dtype


def test_init_from_hf(tmp_path):
    from launch.export import export

    _train("--steps", "2", "--ckpt-dir", str(tmp_path / "ck"))
    export(str(tmp_path / "ck"), str(tmp_path / "hf"))
    rows = _train("--steps", "1", "--init-from-hf", str(tmp_path / "hf"))
    model = Llama(LlamaConfig.preset("tiny"))
    checkpoint.load(tmp_path / "ck", checkpoint.model_state(model), strict=False)
    from launch.data import token_stream
    from launch.tokenizer import ByteTokenizer

    x, y = DataLoader(token_stream("stdlib", ByteTokenizer())[0], 8, 64, seed=0).global_batch(0)
    with torch.no_grad():
        assert rows[0]["loss"] == pytest.approx(float(model(x, y)), rel=1e-6)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_step_checkpoints_and_exits_0(tmp_path, sig):
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", *SMALL, "--steps", "100000", "--ckpt-dir", str(ck), "--metrics", str(m)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (m.exists() and len(m.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no metrics after 120 s"
            time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
    steps = [r["step"] for r in _jsonl(m)]
    assert checkpoint.latest(ck).name == f"step-{steps[-1]}"
    assert checkpoint.read_meta(ck)["data"]["step"] == steps[-1]


@pytest.mark.slow
def test_four_processes_match_one_and_resume_on_one(tmp_path):
    common = [*SMALL, "--steps", "4"]
    ref = _train("--steps", "4")
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    train_on_ranks(
        4,
        [
            *common,
            "--mesh",
            "fsdp=2,tp=2,sp",
            "--grad-accum",
            "2",
            "--ac",
            "full",
            "--ckpt-dir",
            str(ck),
            "--ckpt-every",
            "2",
            "--metrics",
            str(m),
            "--zero",
            "1",
        ],
    )
    rows = _jsonl(m)
    # comm_bytes, measured on the first and on the last step, is two micro-batches of explain's plan of the
    # checkpointed ZeRO-1 step, the first under no_sync (no gradient reductions), its optimizer phase once
    # (the reduce-scatter of the gradients backward held, before clipping, and the all-gather of updated
    # shards), plus global-norm clipping's all-reduces of a few scalars each; grad_norm equal to one process's
    # shows the clip saw reduced gradients
    plan = spmd.explain(
        Llama(LlamaConfig.preset("tiny")),
        spmd.Rules.default(sequence_parallel=True, zero=1),
        {"fsdp": 2, "tp": 2},
        batch_shape=(4, 64),
        ac="full",
    )
    reductions = sum(c.bytes for c in plan.collectives if c.phase == "backward" and "gradient" in c.reason)
    assert plan.comm_bytes("optimizer") > 0
    expected = 2 * plan.comm_bytes() - plan.comm_bytes("optimizer") - reductions
    for r in (rows[0], rows[-1]):
        assert expected <= r["comm_bytes"] <= expected + 1024, (r["step"], r["comm_bytes"], expected)
    for a, b in zip(ref, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # the 4-process ZeRO-1 step-2 checkpoint (DTensor shards) resumes in one process, numbers unchanged
    (ck / "latest").write_text("step-2\n")
    resumed = _train("--steps", "4", "--ckpt-dir", str(ck), "--resume")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(ref[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.slow
def test_pipeline_run_matches_one_process_and_its_checkpoint_resumes_without_pp(tmp_path):
    common = [*SMALL, "--steps", "4"]
    ref = _train("--steps", "4")
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    train_on_ranks(
        4,
        [
            *common,
            "--mesh",
            "pp=2,fsdp=2",
            "--pp-schedule",
            "gpipe",
            "--microbatches",
            "2",
            "--ckpt-dir",
            str(ck),
            "--ckpt-every",
            "2",
            "--metrics",
            str(m),
        ],
    )
    rows = _jsonl(m)
    for a, b in zip(ref, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    (ck / "latest").write_text("step-2\n")
    resumed = _train("--steps", "4", "--ckpt-dir", str(ck), "--resume")
    for a, b in zip(ref[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.slow
def test_context_parallel_run_matches_one_process_and_its_checkpoint_resumes_without_cp(tmp_path):
    """--mesh fsdp=2,cp=2: each cp rank trains on its zigzag share of every sequence; the loss and gradient
    norm equal one process, and the checkpoint (parameters replicated over cp) resumes in one process.
    (The ring's bytes are held against explain in tests/test_context_parallel.py.)"""
    common = [*SMALL, "--steps", "2"]
    ref = _train("--steps", "2")
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    train_on_ranks(
        4, [*common, "--mesh", "fsdp=2,cp=2", "--ckpt-dir", str(ck), "--ckpt-every", "1", "--metrics", str(m)]
    )
    rows = _jsonl(m)
    for a, b in zip(ref, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    (ck / "latest").write_text("step-1\n")
    resumed = _train("--steps", "2", "--ckpt-dir", str(ck), "--resume")
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-5)


def test_bad_input_exits_2_with_the_fix(capsys):
    assert T.main(["--batch-size", "7", "--grad-accum", "2"]) == 2
    assert "use a batch size that is a multiple of 2, e.g. 8" in capsys.readouterr().err
    assert T.main(["--tokenizer", "missing/tokenizer.json", "--steps", "1"]) == 2
    assert "pass 'bytes' or a tokenizer.json" in capsys.readouterr().err
    assert T.main(["--mesh", "cp=2", "--seq-len", "62"]) == 2
    assert "use a length that is a multiple of 4 (e.g. 60)" in capsys.readouterr().err


def _set_loss_scale(step_dir: Path, scale: float) -> None:
    """Rewrites a checkpoint's loss scale, and meta.json's record in its index so that it still verifies."""
    from spmd.checkpoint.verify import file_record

    meta = json.loads((step_dir / "meta.json").read_text())
    meta["loss_scale"]["scale"] = scale
    (step_dir / "meta.json").write_text(json.dumps(meta))
    index = json.loads((step_dir / "index.json").read_text())
    index["files"]["meta.json"] = file_record(step_dir / "meta.json")
    (step_dir / "index.json").write_text(json.dumps(index, indent=1))


def _tensors(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {(f.name, k): v for f in sorted(step_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_fp16_on_four_processes_skips_an_overflowing_step_on_every_rank(tmp_path):
    """fp16 with dynamic loss scaling on fsdp=2,tp=2 on 4 processes. Step 1 trains at the default scale and
    checkpoints; its scale is then set to 2^40, so on resume the scaled gradients of step 2 overflow fp16: the
    step is skipped (skipped_steps 1), the scale halves to 2^39, and every rank's shards of the parameters and
    AdamW states are the step-1 checkpoint's bit for bit. Step 1's loss tracks the fp32 one-process run within
    1e-2 (fp16 keeps 11 bits). Kills a scale that does not back off after an overflow (tests/mutants.py)."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    common = [
        *SMALL,
        "--mesh",
        "fsdp=2,tp=2",
        "--dtype",
        "fp16",
        "--ckpt-dir",
        str(ck),
        "--ckpt-every",
        "1",
        "--metrics",
        str(m),
    ]
    train_on_ranks(4, [*common, "--steps", "1"])
    first = _jsonl(m)[-1]
    assert first["skipped_steps"] == 0
    assert first["loss"] == pytest.approx(_train("--steps", "1")[0]["loss"], rel=1e-2)
    _set_loss_scale(ck / "step-1", 2.0**40)
    train_on_ranks(4, [*common, "--steps", "2", "--resume"])
    row = _jsonl(m)[-1]
    assert row["step"] == 2 and row["skipped_steps"] == 1, row
    assert checkpoint.read_meta(ck / "step-2")["loss_scale"]["scale"] == 2.0**39
    before, after = _tensors(ck / "step-1"), _tensors(ck / "step-2")
    assert before.keys() == after.keys() and len({f for f, _ in before}) >= 4, sorted({f for f, _ in before})
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed[:5]
