"""launch.schedule (warmup + cosine) and launch.metrics (FLOPs/token, MFU, peak table and cache, JSONL)."""

import contextlib
import json
import math

import pytest
import torch

from launch import metrics, schedule
from models.llama import LlamaConfig


def test_warmup_then_cosine_to_ten_percent():
    peak, warmup, total = 1e-3, 10, 110
    lrs = [schedule.lr_at(s, peak, warmup, total) for s in range(total + 5)]
    assert lrs[0] == pytest.approx(peak / warmup) and lrs[warmup - 1] == pytest.approx(peak)
    assert lrs[warmup] == pytest.approx(peak)
    assert lrs[total - 1] == pytest.approx(0.1 * peak) and lrs[-1] == pytest.approx(0.1 * peak)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))
    mid = warmup + 33
    assert lrs[mid] == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 33 / 99))))
    assert schedule.lr_at(0, peak, 0, total) == pytest.approx(peak)  # no warmup


def test_lambda_lr_matches_pure_function():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = schedule.scheduler(opt, warmup=3, total=12)
    for s in range(12):
        assert opt.param_groups[0]["lr"] == pytest.approx(schedule.lr_at(s, 2.0, 3, 12))
        opt.step()
        sched.step()


def test_flops_per_token_formula():
    cfg = LlamaConfig.preset("tiny")
    n = cfg.num_params(non_embedding=True)
    assert metrics.flops_per_token(cfg, 128) == 6 * n + 12 * 2 * 8 * 8 * 128
    # 8B at 8192: 6*N dominates; N_non_embedding is about 6.98e9
    big = LlamaConfig.preset("8b")
    assert metrics.flops_per_token(big, 8192) == 6 * big.num_params(True) + 12 * 32 * 32 * 128 * 8192


@contextlib.contextmanager
def tf32_matmuls(on: bool):
    """Sets torch's TF32 switch through its own setter (it is not a plain attribute, so monkeypatch cannot
    restore it) and puts the previous value back."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_gpu_peak_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    with tf32_matmuls(False):
        assert metrics.peak_flops("bf16", "cuda:0")[0] == 989e12
        assert metrics.peak_flops("fp32", "cuda:0")[0] == 67e12
    with tf32_matmuls(True):
        assert metrics.peak_flops("fp32", "cuda:0")[0] == 494.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert metrics.peak_flops("bf16", "cuda:0")[0] == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    assert metrics.peak_flops("fp16", "cuda:0")[0] == 312e12
    with pytest.raises(ValueError, match="not one of"):
        metrics.peak_flops("int8")


def test_cpu_peak_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(metrics, "measure_gemm_flops", lambda dtype, device: calls.append(dtype) or 1.5e11)
    assert metrics.peak_flops("fp32")[0] == 1.5e11
    assert metrics.peak_flops("fp32")[0] == 1.5e11 and calls == [torch.float32]
    assert metrics.peak_flops("bf16")[0] == 1.5e11 and calls == [torch.float32, torch.bfloat16]
    assert len(json.loads((tmp_path / "peak_flops.json").read_text())) == 2


def test_measure_gemm_is_plausible():
    flops = metrics.measure_gemm_flops(torch.float32, "cpu", budget_s=0.2)
    assert 1e8 < flops < 1e14


def test_jsonl_rows_and_mfu(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    log = metrics.MetricsLogger(
        total_steps=2, tokens_per_step=1000, flops_per_token=6e6, peak=1e12, n_devices=2, jsonl=str(path)
    )
    row = log.record(1, loss=2.5, grad_norm=0.5, lr=1e-3, step_time_s=0.5, peak_mem_bytes=123, comm_bytes=456)
    log.record(2, loss=2.0, grad_norm=0.4, lr=1e-3, step_time_s=0.25, peak_mem_bytes=123, comm_bytes=456)
    log.close()
    assert row["tokens_per_s"] == 2000 and row["mfu"] == pytest.approx(2000 * 6e6 / 2e12)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [tuple(x) for x in lines] == [metrics.KEYS, metrics.KEYS] and lines[1]["step"] == 2
    assert lines[1]["tokens_per_s"] == 4000


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        metrics.MetricsLogger(1, 1, 1, 1.0, 1, tensorboard=str(tmp_path / "tb"))
