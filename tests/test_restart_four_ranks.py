"""A killed 4-rank job restarted by torchrun ends exactly where an uninterrupted job ends, on a tensor-parallel
mesh (`fsdp=2,tp=2,sp`) and on a pipeline (`pp=2,fsdp=2`): the same losses, gradient norms and checkpoint
tensors, bit for bit.

Three launches in all: both uninterrupted references in one tests/dist_utils.run_distributed launch (the trainer
builds its mesh per call, so one 4-rank group runs both meshes in turn), then one torchrun job per mesh in which
tests/fault_injection.py SIGKILLs one rank after the step-2 checkpoint; torchrun ends the whole attempt and
starts a new one (--max-restarts 1), which resumes from step-2 and runs steps 3-4.
"""

import subprocess
import sys

import pytest
from dist_utils import run_distributed

from tests.test_faults import FAULT_TRAIN, REPO, _env, _jsonl
from tests.test_faults_four_ranks import _differing
from tests.test_train import SMALL
from tests.train_ranks import main_on_rank as _main

pytestmark = pytest.mark.usefixtures("isolated_trainer")

STEPS = ["--steps", "4", "--ckpt-every", "2", "--ckpt-keep", "0"]
# each mesh, and the rank killed before step 3 (a tp rank; a rank of the last pipeline stage)
MESHES = {
    "tp": (["--mesh", "fsdp=2,tp=2,sp"], 1),
    "pp": (["--mesh", "pp=2,fsdp=2", "--pp-schedule", "gpipe", "--microbatches", "2"], 3),
}


def _uninterrupted_runs(rank, world, tmp):
    for name, (mesh, _) in MESHES.items():
        code, err = _main(
            [*SMALL, *mesh, *STEPS, "--ckpt-dir", f"{tmp}/{name}-ref/ck", "--metrics", f"{tmp}/{name}-ref/m.jsonl"]
        )
        assert code == 0, err[-3000:]


def _killed_and_restarted(tmp, name):
    mesh, victim = MESHES[name]
    ck, m = tmp / f"{name}-killed" / "ck", tmp / f"{name}-killed" / "m.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "1",
        FAULT_TRAIN,
        "--fault",
        f"{victim}:3:kill",
        *SMALL,
        *mesh,
        *STEPS,
        "--ckpt-dir",
        str(ck),
        "--metrics",
        str(m),
        "--resume",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"rank {victim}: kill before step 3" in out.stderr
    assert f"resumed from {ck / 'step-2'} at step 2 (torchrun restart 1)" in out.stdout
    return ck, _jsonl(m)


@pytest.mark.slow
def test_a_killed_job_restarts_exactly_on_tp_and_pp_meshes(tmp_path):
    """Per mesh: the killed job's metrics (steps 1-2 of the first attempt, 3-4 of the restart) equal the
    uninterrupted job's row for row (step, loss, grad_norm, lr), and its step-2 and step-4 checkpoints hold the
    same tensors (parameters, AdamW moments and step counts), compared with torch.equal.
    Mutation killed: launch/train.py without `loader.load_state_dict(meta["data"])` on resume (the restart
    trains steps 3-4 on the batches of steps 1-2): step 3's loss and every step-4 tensor differ."""
    run_distributed(_uninterrupted_runs, 4, str(tmp_path), timeout_s=400)
    for name in MESHES:
        ref_ck, ref = tmp_path / f"{name}-ref" / "ck", _jsonl(tmp_path / f"{name}-ref" / "m.jsonl")
        ck, rows = _killed_and_restarted(tmp_path, name)
        keys = ("step", "loss", "grad_norm", "lr")
        assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in ref], name
        assert [r["step"] for r in rows] == [1, 2, 3, 4], name
        for step in (2, 4):
            assert _differing(ck / f"step-{step}", ref_ck / f"step-{step}") == [], (name, step)
