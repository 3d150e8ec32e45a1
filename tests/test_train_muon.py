"""launch.train --optimizer muon: one process trains with spmd.Muon at --muon-lr on the matrices and AdamW at
--lr on the rest (the schedule keeps their ratio), its checkpoint resumes exactly, and bad combinations are
refused with the fix. The numerics on sharded meshes are tests/test_muon.py's."""

import pytest

import launch.train as T
from launch.config import load_config

SMALL = ["--batch-size", "8", "--seq-len", "64", "--warmup", "2", "--lr", "3e-3", "--optimizer", "muon"]


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def test_muon_trains_and_resumes_exactly(tmp_path, monkeypatch):
    """Mutation checked: `set_lr` ignoring `lr_scale` (Muon at AdamW's 3e-3) fails the lr assertion."""
    seen = []
    original = T.optimizer

    def spy(model, cfg):
        opt = original(model, cfg)
        seen.append(opt)
        return opt

    monkeypatch.setattr(T, "optimizer", spy)
    ck = tmp_path / "ck"
    straight = T.train(load_config(SMALL + ["--steps", "4", "--ckpt-dir", str(ck), "--ckpt-every", "2"]), log=False)
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.2
    muon, *adamw = seen[0].param_groups
    assert muon["use_muon"] and muon["lr"] == pytest.approx(0.02 * straight[-1]["lr"] / 3e-3)
    assert all(not g["use_muon"] and g["lr"] == pytest.approx(straight[-1]["lr"]) for g in adamw)
    (ck / "latest").write_text("step-2\n")
    resumed = T.train(load_config(SMALL + ["--steps", "4", "--ckpt-dir", str(ck), "--resume"]), log=False)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]


@pytest.mark.parametrize(
    "flags,world,match",
    [
        (["--mesh", "pp=2,fsdp=2"], 4, "--optimizer muon exchanges whole matrices over the whole mesh"),
        (["--offload", "optimizer", "--zero", "1"], 4, "leave --offload out, or use --optimizer adamw"),
        (["--muon-lr", "0"], 1, "--muon-lr must be positive"),
    ],
)
def test_muon_refusals_name_the_fix(flags, world, match):
    with pytest.raises(ValueError, match=match):
        load_config(SMALL + flags).validate(world)


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="--optimizer 'sgd' is not supported; use adamw, muon or onebit-adam"):
        load_config(["--optimizer", "sgd"]).validate(1)
