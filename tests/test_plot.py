"""launch.plot: two metrics files become one PNG with a loss, a tokens/s and an MFU panel, a line per run."""

import json
import sys

import pytest

from launch import plot
from launch.metrics import KEYS


def _metrics(path, steps, loss0):
    rows = [dict(zip(KEYS, (s, loss0 / s, 1.0, 1e-3, 1000.0 + s, 0.01 * s, 0.1, 0, 0))) for s in range(1, steps + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_two_runs_one_png(tmp_path, capsys):
    a, b = _metrics(tmp_path / "fsdp4.jsonl", 20, 6.0), _metrics(tmp_path / "tp4.jsonl", 12, 5.0)
    out = tmp_path / "plots" / "runs.png"
    assert plot.main([str(a), str(b), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    fig = plot.draw({"fsdp4.jsonl": plot.read_metrics(a), "tp4.jsonl": plot.read_metrics(b)})
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "tokens/s", "MFU (%)"]
    for ax in fig.axes:
        assert [line.get_label() for line in ax.get_lines()] == ["fsdp4.jsonl", "tp4.jsonl"]
    mfu = fig.axes[2].get_lines()[1]
    assert list(mfu.get_xdata()) == list(range(1, 13)) and mfu.get_ydata()[-1] == pytest.approx(12.0)


def test_bad_inputs_are_clear_errors(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\n')
    out = str(tmp_path / "x.png")
    assert plot.main([str(bad), "--out", out]) == 2
    assert "bad.jsonl:1 lacks tokens_per_s, mfu" in capsys.readouterr().err
    assert plot.main([str(tmp_path / "none.jsonl"), "--out", out]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    assert plot.main([str(_metrics(tmp_path / "ok.jsonl", 3, 1.0)), "--out", out]) == 2
    assert "needs matplotlib: pip install 'spmd[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
