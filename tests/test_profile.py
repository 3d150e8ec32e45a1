"""--profile-steps: a short run writes a rank-tagged Chrome trace of the chosen steps that parses as JSON."""

import json
import warnings

import pytest
import torch

import launch.train as T
from launch.config import load_config
from launch.profile import StepProfiler


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(T, "peak_flops", lambda dtype, device: (1e11, "test"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_profile_steps_write_a_trace(tmp_path):
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "prof"
    T.train(
        load_config(
            [
                "--data",
                str(tmp_path / "corpus.txt"),
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--profile-steps",
                "2:3",
                "--profile-dir",
                str(out),
            ]
        ),
        log=False,
    )
    assert [p.name for p in out.iterdir()] == ["rank00000-steps2-3.pt.trace.json"]
    events = json.loads((out / "rank00000-steps2-3.pt.trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert len(events) > 100 and {n for n in names if n.startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
    }
    assert any(n.startswith("aten::mm") for n in names)


@pytest.mark.parametrize(
    "spec, match",
    [("3", "is not A:B"), ("0:2", "1 <= A <= B"), ("4:2", "1 <= A <= B"), ("2:9", "ends after the last step")],
)
def test_bad_profile_steps(spec, match):
    with pytest.raises(ValueError, match=match):
        load_config(["--steps", "5", "--profile-steps", spec]).validate(1)


def test_cuda_memory_snapshot_of_the_profiled_steps(tmp_path, monkeypatch):
    """The CUDA branch, with the allocator's history calls stubbed (this test runs without a GPU): history is
    recorded from step A, dumped next to the trace after step B, then switched off."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda f: (calls.append(f), open(f, "wb").close()))
    prof = StepProfiler("2:3", str(tmp_path), 3, torch.device("cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available, disabling CUDA profiling"
        for step in (1, 2, 3):
            prof.before(step)
            assert calls == ([] if step == 1 else [{"max_entries": 200_000}])
            torch.mm(torch.randn(4, 4), torch.randn(4, 4))
            written = prof.after(step)
    assert [p.name for p in written] == ["rank00003-steps2-3.pt.trace.json", "rank00003-steps2-3.memory.pickle"]
    assert calls[1:] == [str(written[1]), {"enabled": None}] and written[0].is_file()
