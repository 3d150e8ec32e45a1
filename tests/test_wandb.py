"""--wandb: the flag reaches the config, a missing package is a clear error, and with no WANDB_MODE set the
run is written offline (no network needed) with the metrics rows in it."""

import os
import sys
import time

import pytest

from launch.config import load_config
from launch.metrics import MetricsLogger


def _logger(tmp_path, **kw):
    return MetricsLogger(
        total_steps=2,
        tokens_per_step=64,
        flops_per_token=10,
        peak=1e9,
        n_devices=1,
        console=False,
        wandb="spmd-test",
        run_config={"model": "tiny"},
        **kw,
    )


def test_flag_parses():
    assert load_config(["--wandb", "my-project"]).wandb == "my-project"
    assert load_config([]).wandb == ""


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(ImportError, match=r"--wandb needs the wandb package: pip install 'spmd\[wandb\]'"):
        _logger(tmp_path)


def test_offline_run_writes_its_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.delenv("WANDB_MODE")  # unset, restored afterwards
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = _logger(tmp_path)
    for step in (1, 2):
        log.record(step, loss=3.0 - step, grad_norm=1.0, lr=1e-3, step_time_s=0.5, peak_mem_bytes=0, comm_bytes=0)
    log.close()
    assert os.environ["WANDB_MODE"] == "offline"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    deadline = time.monotonic() + 30  # wandb's service process finishes writing the file after finish()
    while b"train/tokens_per_s" not in next(runs[0].glob("run-*.wandb")).read_bytes():
        assert time.monotonic() < deadline, "the offline run holds no metrics rows"
        time.sleep(0.2)
