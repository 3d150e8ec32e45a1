"""The benchmark scripts' own logic: rank correlation, the link fit, the comparison rows, report builders,
and (slow) that the torch-native baseline trains the same model to the same losses as launch.train."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import spmd
from benchmarks import analytic, common, compare_comm, mfu
from benchmarks.search_vs_measured import fit_link, spearman

ROOT = Path(__file__).resolve().parents[1]


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # average ranks for ties
    assert math.isnan(spearman([1], [2]))


def test_link_fit_recovers_latency_step_latency_and_bandwidth():
    # all-reduces and all-gathers over 4 and 2 ranks: 6, 2, 3 and 1 ring steps
    rows = [
        {"kind": kind, "ranks": n, "wire_bytes": b, "seconds": 2e-4 + steps * 5e-4 + b / 3e9}
        for kind, n, steps in (("all_reduce", 4, 6), ("all_reduce", 2, 2), ("all_gather", 4, 3), ("all_gather", 2, 1))
        for b in (1e3, 1e5, 1e6, 1e7)
    ]
    fit = fit_link(rows, 4)
    assert fit["latency_s"] == pytest.approx(2e-4, rel=1e-6)
    assert fit["step_latency_s"] == pytest.approx(5e-4, rel=1e-6)
    assert fit["bandwidth_Bps"] == pytest.approx(3e9, rel=1e-6)
    # a report's samples without group sizes were timed over all processes; a term that would fit negative
    # is dropped (here the fixed latency: every sample costs steps x 1 ms + bytes / 2 GB/s)
    old = [
        {"kind": kind, "wire_bytes": b, "seconds": steps * 1e-3 + b / 2e9}
        for kind, steps in (("all_reduce", 6), ("all_gather", 3))
        for b in (1e3, 1e5, 1e6, 1e7)
    ]
    fit = fit_link(old, 4)
    assert fit["latency_s"] == pytest.approx(0, abs=1e-9) and fit["step_latency_s"] == pytest.approx(1e-3, rel=1e-6)
    assert fit["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)


@pytest.mark.parametrize("spec", ["fsdp=2,tp=2,sp", "dp=2,fsdp=2", "tp=4,sp"])
def test_compare_row_on_a_fake_world(spec):
    cfg = compare_comm.model_config("tiny")
    row = compare_comm.compare_row("tiny", cfg, spec, 8, 16, "fp32", None)
    assert row["ratios"]["explain/analytic"] == 1
    assert row["ratios"]["explain/analytic states"] == 1
    assert row["explain"]["implicit"] == 0
    an = row["analytic"]
    # the analytic model's textbook terms are DESIGN.md's closed forms (Megatron 8bsh(t-1)/t per block, ZeRO-3
    # 3Ψ, DP 2Ψ), up to rounding each collective down to whole bytes
    assert abs(an["textbook_bytes"] - analytic.textbook_comm(cfg, spec, 8, 16, "fp32")["total"]) <= an["count"]
    # a step moves every textbook byte and more (loss statistics, TP outside the blocks, SP norm gradients),
    # less the one thing ZeRO-3's 3Ψ counts that the step skips: the root unit's backward gather (embedding,
    # output and final norm stay gathered from forward, as FSDP2's root does)
    sizes, _ = spmd.parse_spec(spec)
    fsdp, tp = sizes.get("fsdp", 1), sizes.get("tp", 1)
    skipped = (2 * cfg.vocab_size * cfg.dim // tp + cfg.dim) * 4 * (fsdp - 1) // fsdp
    assert an["textbook_bytes"] - skipped < an["bytes"]


def test_steady_summary_drops_warmup():
    rows = [
        {
            "step": i,
            "loss": 1.0,
            "tokens_per_s": t,
            "mfu": 0.1,
            "step_time_s": 1 / t,
            "peak_mem_bytes": 5,
            "comm_bytes": 7,
        }
        for i, t in enumerate([1.0, 100.0, 110.0, 90.0], 1)
    ]
    s = common.steady(rows, 1)
    assert s["steps"] == 3 and s["tokens_per_s"] == 100.0 and s["comm_bytes"] == 7


def test_mfu_markdown_shows_ratios():
    row = {
        "tokens_per_s": 200.0,
        "mfu": 0.02,
        "step_time_s": 0.5,
        "peak_mem_bytes": 2**20,
        "comm_bytes": 10.0,
        "notes": [],
        "losses": [1.0],
        "step_time_spread": 0.1,
    }
    rep = {
        "environment": {"device": "cpu x", "date": "d", "torch": "t", "cpu_count": 2},
        "args": {
            "model": "tiny",
            "nproc": 4,
            "batch_size": 8,
            "seq_len": 16,
            "dtype": "fp32",
            "compile": False,
            "steps": 4,
            "warmup": 1,
            "rounds": 3,
        },
        "single": {**row, "tokens_per_s": 100.0},
        "rows": [
            {
                "spec": "fsdp=4",
                "spmd": row,
                "native": {**row, "tokens_per_s": 400.0},
                "vs_native": mfu.ratio_stats([0.5, 0.45, 0.55]),
            }
        ],
        "max_loss_diff": 0.0,
        "max_spread": 0.1,
    }
    md = mfu.markdown(rep)
    assert "| fsdp=4 | spmd | 200 |" in md and "| 0.500 [0.450, 0.550] slower | 2.000 |" in md


def test_ratio_over_rounds_is_even_when_its_range_covers_one():
    assert mfu.ratio_stats([0.97, 1.02, 1.05])["verdict"] == "even"
    assert mfu.ratio_stats([1.01, 1.2, 1.1])["verdict"] == "faster"
    s = mfu.ratio_stats([0.6, 0.9, 0.7, 0.8, 0.75])
    assert (s["verdict"], s["median"], s["min"], s["max"], s["rounds"]) == ("slower", 0.75, 0.6, 0.9, 5)


def test_median_interval_covers_the_median_as_often_as_it_states():
    """The order-statistic interval of benchmarks.overhead: with five rounds it is their range (coverage
    1 - 2/32); over many samples of 60 rounds from a distribution whose median is 1 it covers 1 at least as
    often as it states, and it is narrower than the range; a shifted sample is ordered."""
    import random

    five = common.median_interval([0.97, 1.2, 1.02, 1.1, 1.05])
    assert (five["low"], five["high"], five["median"], five["verdict"]) == (0.97, 1.2, 1.05, "even")
    assert five["coverage"] == pytest.approx(1 - 2 / 32)
    rng = random.Random(0)
    samples = [[rng.lognormvariate(0.0, 0.1) for _ in range(60)] for _ in range(400)]
    intervals = [common.median_interval(s) for s in samples]
    stated = intervals[0]["coverage"]
    assert all(i["coverage"] == stated for i in intervals) and 0.95 <= stated < 0.99
    assert sum(i["low"] <= 1.0 <= i["high"] for i in intervals) / len(intervals) >= stated - 0.03
    assert all(i["high"] - i["low"] < 0.5 * (max(s) - min(s)) for i, s in zip(intervals, samples))
    shifted = common.median_interval([1.08 * x for x in samples[0]])
    assert shifted["verdict"] == "above 1" and shifted["low"] > 1.0


def test_overhead_ratio_is_the_median_of_paired_rounds():
    """Each round's two steps ran back to back, so the ratio pairs them: here the ratio of the medians would
    be 1.25, the median of the rounds' ratios is 2."""
    from benchmarks.overhead import _summary

    s = _summary({"plain": [1.0, 4.0, 10.0], "spmd": [2.0, 20.0, 5.0]})
    assert s["step_s"] == {"plain": 4.0, "spmd": 5.0}
    assert s["ratio_to_plain"]["spmd"] == 2.0 and s["ratio_interval"]["spmd"]["rounds"] == 3


def test_overhead_pairs_spmd_with_each_native_wrapper():
    """spmd against DDP and FSDP2 is the median of the rounds' ratios, as each ratio to plain is."""
    from benchmarks.overhead import _summary

    s = _summary({"plain": [1.0, 1.0, 1.0], "spmd": [2.0, 3.0, 4.0], "ddp": [1.0, 3.0, 8.0], "fsdp2": [4.0, 3.0, 2.0]})
    assert s["spmd_over_native"]["ddp"]["median"] == 1.0 and s["spmd_over_native"]["fsdp2"]["median"] == 1.0
    assert s["ratio_to_plain"]["ddp"] == 3.0 and "spmd_over_native" not in _summary({"plain": [1.0], "ddp": [1.0]})


def _native_references_train_as_plain(rank, world):
    import torch

    from benchmarks import overhead

    losses = {}
    for variant in ("plain", "ddp", "fsdp2"):
        cfg, model, opt = overhead.build("tiny", variant, "fp32")
        x, y = (torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
        step = overhead.step_fn(model, opt, x, y, variant, "fp32")
        losses[variant] = [step() for _ in range(3)]
    assert losses["plain"][2] < losses["plain"][0]  # the steps train
    for variant in ("ddp", "fsdp2"):
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses[variant], losses["plain"])), losses


def test_overhead_native_references_train_the_same_model():
    """The native references are the same training step: DDP and fully_shard on the 1-process group give plain
    PyTorch's losses step for step (fp32, rtol 1e-5), so their ratio to plain is the wrapper's cost alone."""
    from tests.dist_utils import run_distributed

    run_distributed(_native_references_train_as_plain, 1, timeout_s=180)


@pytest.mark.slow
def test_overhead_pools_the_rounds_of_fresh_processes():
    """`--processes 2`: two fresh interpreters each measure every round; the report pools their rounds, keeps
    each process's own ratio, and profiles once."""
    import torch

    from benchmarks.overhead import measure_in_processes

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        r = measure_in_processes(2, "tiny", "fp32", 3, 1, ["plain", "spmd"], False, 2, 8)
    finally:
        torch.set_num_threads(threads)
    assert r["threads"] == 1  # the fresh processes ran with this process's thread count
    assert len(r["times"]["plain"]) == len(r["times"]["spmd"]) == 6 and r["ratio_interval"]["spmd"]["rounds"] == 6
    per_process = r["ratio_per_process"]["spmd"]
    assert len(per_process) == 2 and all(x > 0 for x in per_process)
    # rounds of equal number: the pooled median lies between the processes' own medians
    assert min(per_process) <= r["ratio_to_plain"]["spmd"] <= max(per_process) and "profile_spmd" in r


def test_hf_llama_compares_models_of_one_shape(tmp_path):
    """The directory benchmarks.hf_llama writes holds transformers' Llama of the preset's shape: the same
    parameter count, the same FLOPs per token."""
    pytest.importorskip("transformers")
    from benchmarks.hf_llama import _write_dir
    from models.llama import LlamaConfig
    from models.transformers_lm import TransformersConfig

    for preset in ("tiny", "small"):
        ours, theirs = LlamaConfig.preset(preset), TransformersConfig.preset(_write_dir(preset, tmp_path / preset))
        assert theirs.num_params() == ours.num_params() > 0
        assert theirs.flops_per_token(128) == ours.flops_per_token(128)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["fsdp=2", "tp=2,sp"])
def test_native_baseline_trains_like_launch_train(spec, tmp_path):
    """Same data, initialisation, optimizer and schedule: the torch-native layout's losses equal ours."""
    sizes = spec.replace(",sp", "")
    common_args = [
        "--model",
        "tiny",
        "--mesh",
        sizes,
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--lr",
        "3e-3",
        "--warmup",
        "2",
    ] + (["--sp"] if ",sp" in spec else [])
    losses = {}
    for name, module in (("spmd", "launch.train"), ("native", "benchmarks.native_train")):
        out = tmp_path / f"{name}.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            module,
            *common_args,
            "--metrics",
            str(out),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    print(spec, losses)
    assert losses["spmd"] == pytest.approx(losses["native"], rel=2e-5)
