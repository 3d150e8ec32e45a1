"""launch.train when things go wrong: ranks started with different configs, a rank that dies or hangs, a kill
and a torchrun restart, a kill during a save, damaged checkpoints, non-finite steps.

Every fault is installed deterministically by tests/fault_injection.py (patching the trainer's and the writer's
own functions; child processes run tests/fault_train.py); time bounds are generous ceilings, never races.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fault_injection
import pytest

import launch.train as T
from launch.startup import code_version
from spmd import checkpoint
from tests.test_train import SMALL, _train
from tests.train_ranks import train_on_ranks

pytestmark = pytest.mark.usefixtures("isolated_trainer")

REPO = Path(__file__).resolve().parents[1]
FAULT_TRAIN = str(REPO / "tests" / "fault_train.py")


def _env(**extra):
    return {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _tensors(step_dir) -> dict:
    return {k: checkpoint.read_full(step_dir, k) for k in checkpoint.tensor_names(step_dir)}


def _same_tensors(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)


def test_the_loop_and_the_writer_hold_no_test_code():
    """Faults come from tests/fault_injection.py only: no product module reads a test variable or imports it.
    Mutation killed: an `os.environ.get("SPMD_TEST_...")` check put back into the loop or the writer."""
    product = [p for room in ("spmd", "launch", "models", "kernels") for p in (REPO / room).rglob("*.py")]
    offenders = [
        str(p.relative_to(REPO)) for p in product if "SPMD_TEST" in p.read_text() or "fault_injection" in p.read_text()
    ]
    assert product and offenders == []


# ------------------------------------------------------------------------------ kills and damaged checkpoints
def test_kill_during_a_save_resumes_the_previous_checkpoint_with_its_values(tmp_path):
    """One process, a checkpoint every step: files 1-9 are steps 1-3 (rank file, meta.json, index.json each);
    the 10th is step 4's rank file, after which the save kills its own process."""
    ref = _train("--steps", "5", "--ckpt-dir", str(tmp_path / "ref"), "--ckpt-every", "1", "--ckpt-keep", "0")
    ck = tmp_path / "ck"
    flags = [*SMALL, "--steps", "5", "--ckpt-dir", str(ck), "--ckpt-every", "1", "--ckpt-keep", "0"]
    out = subprocess.run(
        [sys.executable, FAULT_TRAIN, "--kill-after-files", "10", *flags],
        cwd=REPO,
        timeout=300,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert checkpoint.latest(ck).name == "step-3" and (ck / ".tmp-step-4" / "rank-00000.safetensors").is_file()
    assert _same_tensors(ck / "step-3", tmp_path / "ref" / "step-3")  # values, not only the step number
    resumed = _train("--steps", "5", "--ckpt-dir", str(ck), "--resume")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in ref[3:]
    ]
    assert _same_tensors(ck / "step-5", tmp_path / "ref" / "step-5")


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_skips_a_truncated_or_altered_checkpoint_and_says_so(tmp_path, capsys):
    ck = tmp_path / "ck"
    straight = _train("--steps", "6", "--ckpt-dir", str(ck), "--ckpt-every", "2")
    rank_file = ck / "step-6" / "rank-00000.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-1000])  # truncated
    resumed = _train("--steps", "6", "--ckpt-dir", str(ck), "--resume")
    err = capsys.readouterr().err
    assert f"checkpoint {ck / 'step-6'} is damaged (rank-00000.safetensors has" in err
    assert f"falling back to {ck / 'step-4'}" in err
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in straight[4:]]

    _flip_a_byte(ck / "step-6" / "rank-00000.safetensors")  # step-6 was written again by the resumed run
    _flip_a_byte(ck / "step-4" / "rank-00000.safetensors")  # altered, same size
    resumed = _train("--steps", "6", "--ckpt-dir", str(ck), "--resume")
    err = capsys.readouterr().err
    assert "rank-00000.safetensors does not match its SHA-256 in the index (altered)" in err
    assert f"falling back to {ck / 'step-2'}" in err
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in straight[2:]]

    for step in (2, 6):  # step-4 is still altered: the last resume saved step-6 only
        _flip_a_byte(ck / f"step-{step}" / "rank-00000.safetensors")
    assert T.main([*SMALL, "--steps", "6", "--ckpt-dir", str(ck), "--resume"]) == T.EXIT_BAD_INPUT
    assert "no intact checkpoint in" in capsys.readouterr().err


# ------------------------------------------------------------------------------ non-finite steps
def test_a_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    fault_injection.nan_steps(monkeypatch.setattr, {3})
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    _train("--steps", "4", "--ckpt-dir", str(ck), "--ckpt-every", "1", "--ckpt-keep", "0", "--metrics", str(m))
    rows = _jsonl(m)
    assert math.isnan(rows[2]["loss"]) and math.isnan(rows[2]["grad_norm"])
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1]
    # parameters and every optimizer state (moments, step count) after the skipped step equal those before it
    assert _same_tensors(ck / "step-3", ck / "step-2")
    assert not _same_tensors(ck / "step-4", ck / "step-3") and math.isfinite(rows[3]["loss"])


def test_consecutive_nonfinite_steps_stop_the_run_with_the_last_good_state(tmp_path, monkeypatch, capsys):
    fault_injection.nan_steps(monkeypatch.setattr, {3, 4, 5, 6, 7})
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    code = T.main(
        [
            *SMALL,
            "--steps",
            "10",
            "--max-bad-steps",
            "3",
            "--ckpt-dir",
            str(ck),
            "--ckpt-every",
            "2",
            "--metrics",
            str(m),
        ]
    )
    assert code == T.EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "steps 3..5 had a non-finite loss or gradient norm (3 in a row, --max-bad-steps 3)" in err
    assert f"those after step 2, the last good step, saved in {ck / 'step-5'}" in err
    assert [r["skipped_steps"] for r in _jsonl(m)] == [0, 0, 1, 2, 3]
    assert checkpoint.latest(ck).name == "step-5" and _same_tensors(ck / "step-5", ck / "step-2")
    meta = checkpoint.read_meta(ck)
    assert meta["bad_steps"] == {"skipped": 3, "streak": 3, "last_good": 2}
    assert meta["code_version"] == code_version()


# ------------------------------------------------------------------------------ several processes
def test_the_config_diff_names_each_differing_field_with_its_ranks():
    from launch.startup import describe, differences

    same = {"mesh": "fsdp=2", "steps": 10}
    per_rank = [dict(same, batch_size=16)] * 9 + [dict(same, batch_size=32, seed=1)]
    diff = differences(per_rank)
    assert list(diff) == ["batch_size", "seed"]
    assert describe(diff) == (
        "batch_size: 16 on ranks 0..8 (9 ranks), 32 on rank 9\n"
        "  - seed: '<missing>' on ranks 0..8 (9 ranks), 1 on rank 9"
    )
    assert differences([same, dict(same)]) == {}


def _torchrun(*args, env=None, restarts=0):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_ranks_with_different_configs_all_fail_naming_the_fields(tmp_path):
    """Rank 1 gets --batch-size 32 and other sources (tests/rank_args.py): without the check each rank
    would train on its own batch; with it every rank fails before training, naming both differences."""
    m = tmp_path / "m.jsonl"
    out = _torchrun(
        "tests/rank_args.py",
        *SMALL,
        "--steps",
        "2",
        "--metrics",
        str(m),
        env=_env(SPMD_TEST_RANK1_ARGS="--batch-size 32", SPMD_TEST_RANK1_CODE_VERSION="other-sources"),
    )
    assert out.returncode != 0
    for rank in (0, 1):
        assert (
            f"launch.train [rank {rank}]: error: the 2 ranks were started with different configs, so none "
            f"of them trains:" in out.stderr
        )
    assert out.stderr.count("  - batch_size: 8 on rank 0, 32 on rank 1\n") == 2
    assert out.stderr.count("'other-sources' on rank 1\n") == 2
    assert "fix: start every rank with the same flags and config file; install the same code" in out.stderr
    assert not m.exists(), "no rank may train"


def _two_ranks(tmp_path, *flags, fault):
    """Two trainer processes joined as torchrun joins them (the test serves the store, as torchrun's agent
    does, on a port the OS assigns and holds), but with no agent to stop the survivor: what the survivor does
    is the trainer's own doing. Returns (store, processes, stderr files); keep the store until they end."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    procs, logs = [], []
    for rank in (0, 1):
        logs.append(tmp_path / f"rank{rank}.err")
        env = _env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        cmd = [sys.executable, FAULT_TRAIN, "--fault", fault, *SMALL, "--steps", "6", *flags]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(logs[-1], "w")))
    return store, procs, logs


def _wait_for(path, text, limit_s=240):
    deadline = time.monotonic() + limit_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.05)
    return time.monotonic()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exit", "hang"])
def test_survivors_of_a_dead_or_stuck_rank_exit_in_bounded_time_and_say_why(tmp_path, kind):
    """Rank 1 crashes (exit) or stops responding (hang) before step 3. Rank 0 must not wait for ever: a crash
    closes the connection at once, a hang hits --collective-timeout (5 s here)."""
    _store, procs, logs = _two_ranks(tmp_path, "--collective-timeout", "5", fault=f"1:3:{kind}")
    try:
        fault_at = _wait_for(logs[1], f"rank 1: {kind} before step 3")
        code = procs[0].wait(timeout=120)
        waited = time.monotonic() - fault_at
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = logs[0].read_text()
    print(f"rank 0 exited {waited:.1f} s after rank 1's {kind}")
    assert code == T.EXIT_RANK_LOST, err[-2000:]
    assert "launch.train [rank 0]: error: a collective failed" in err
    assert (
        "another rank died, was killed or stopped responding (collectives wait at most --collective-timeout "
        "5 s), so this rank stops too" in err
    )
    if kind == "hang":
        assert "Timed out" in err  # ended by the timeout, not by a closed connection
    assert waited < 60


def _subgroup_collective_times_out(rank, world, done):
    import torch
    import torch.distributed as dist

    from launch.startup import start_process_group

    start_process_group(3.0, torch.device("cpu"))  # the group is up already: this sets the sub-groups' timeout
    group = dist.new_group([0, 1])  # how DeviceMesh and the pipeline make theirs
    if rank == 1:  # stays alive but never joins the collective, until rank 0 is done with it
        while not Path(done).exists():
            time.sleep(0.05)
        return
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out"):
        dist.all_reduce(torch.ones(1), group=group)
    Path(done).touch()
    assert time.monotonic() - began < 60  # torch's own default for a sub-group would be 30 minutes


@pytest.mark.slow
def test_sub_groups_get_the_collective_timeout(tmp_path):
    from dist_utils import run_distributed

    run_distributed(_subgroup_collective_times_out, 2, str(tmp_path / "done"), timeout_s=120)


@pytest.mark.slow
def test_a_killed_rank_restarted_by_torchrun_resumes_and_matches_an_uninterrupted_run(tmp_path):
    """Rank 1 SIGKILLs itself before step 5 on torchrun's first attempt; torchrun restarts the group, which
    resumes from step-4 (a restart resumes without --resume) and ends where an uninterrupted run ends, loss for
    loss and tensor for tensor."""

    def run(name, *fault):
        ck, m = tmp_path / name / "ck", tmp_path / name / "m.jsonl"
        flags = [*SMALL, "--steps", "6", "--ckpt-dir", str(ck), "--ckpt-every", "2", "--metrics", str(m)]
        if not fault:  # the uninterrupted reference: the trainer on 2 forked ranks, no launcher under test
            train_on_ranks(2, flags)
            return None, ck, _jsonl(m)
        out = _torchrun(*fault, *flags, restarts=1)
        assert out.returncode == 0, out.stderr[-3000:]
        return out, ck, _jsonl(m)

    _, ref_ck, ref = run("straight")
    out, ck, rows = run("killed", FAULT_TRAIN, "--fault", "1:5:kill")
    assert (
        "rank 1: kill before step 5" in out.stderr
        and f"resumed from {ck / 'step-4'} at step 4 (torchrun restart 1)" in out.stdout
    )
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in ref
    ]
    assert _same_tensors(ck / "step-6", ref_ck / "step-6")
