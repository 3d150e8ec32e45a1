"""launch.train --optimizer onebit-adam: one process trains with spmd.OneBitAdam (N = 1: the worker's and the
server's compressions, no communication), a checkpoint taken after compressed steps resumes exactly, and
meshes it cannot run on are refused with the fix before any collective. The numerics on 4 ranks are
tests/test_onebit_adam.py's."""

import pytest

import launch.train as T
import spmd
from launch.config import load_config

SMALL = ["--batch-size", "8", "--seq-len", "64", "--warmup", "2", "--lr", "3e-3", "--optimizer", "onebit-adam"]


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def test_onebit_adam_trains_and_resumes_exactly_after_warm_up(tmp_path, monkeypatch):
    """Two exact steps, then compressed ones; the checkpoint after step 3 holds non-zero error feedback and
    resumes to the same losses. Mutation checked: the phase kept in a counter on the optimizer instead of
    read from the state's `step` (so a resumed run warms up again) fails the resumed losses (5.21 != 5.08)."""
    seen = []
    original = T.optimizer

    def spy(model, cfg):
        seen.append(original(model, cfg))
        return seen[-1]

    monkeypatch.setattr(T, "optimizer", spy)
    ck = tmp_path / "ck"
    flags = SMALL + ["--steps", "5", "--onebit-warmup", "2", "--ckpt-dir", str(ck)]
    straight = T.train(load_config(flags + ["--ckpt-every", "3"]), log=False)
    opt = seen[0]
    assert isinstance(opt, spmd.OneBitAdam) and opt.warmup == 2 and opt.steps_done() == 5
    assert all(opt.state[p]["worker_error"].abs().sum() > 0 for p in opt.param_groups[0]["params"])
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.2
    (ck / "latest").write_text("step-3\n")
    resumed = T.train(load_config(flags + ["--resume"]), log=False)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]


@pytest.mark.parametrize(
    "flags,world,match",
    [
        (["--mesh", "fsdp=2,tp=2"], 4, "--mesh has tp=2: use a mesh of dp and fsdp only"),
        (["--mesh", "pp=2,dp=2"], 4, "--mesh has pp=2: use a mesh of dp and fsdp only"),
        (["--mesh", "dp=2,fsdp=2", "--zero", "1"], 4, "use --zero 3"),
        (["--offload", "optimizer"], 4, "leave --offload out"),
        (["--onebit-warmup", "0"], 1, "--onebit-warmup must be >= 1"),
    ],
)
def test_onebit_refusals_name_the_fix(flags, world, match):
    with pytest.raises(ValueError, match=match):
        load_config(SMALL + flags).validate(world)


def test_onebit_adam_refuses_a_tensor_parallel_model():
    """The optimizer itself refuses a layout it cannot run on (before any collective: it builds none)."""
    from types import SimpleNamespace

    from spmd.optim.onebit_adam import _check_layout
    from spmd.runtime.state import STATE_ATTR
    from tests.spmd_cases import tiny_model

    model = tiny_model()
    mesh = SimpleNamespace(mesh_dim_names=("fsdp", "tp"), shape=(2, 2))
    setattr(model, STATE_ATTR, SimpleNamespace(mesh=mesh, offload=None, master="params"))
    with pytest.raises(ValueError, match="this mesh also has tp=2: use a mesh of dp and fsdp only"):
        _check_layout(model)


def test_onebit_adam_from_toml(tmp_path):
    """The TOML keys are the flags' names: `optimizer = "onebit-adam"`, `onebit_warmup = N`."""
    path = tmp_path / "run.toml"
    path.write_text('optimizer = "onebit-adam"\nonebit_warmup = 7\nmesh = "dp=2,fsdp=2"\n')
    cfg = load_config(["--config", str(path)]).validate(4)
    assert (cfg.optimizer, cfg.onebit_warmup) == ("onebit-adam", 7)
    path.write_text('optimizer = "onebit-adam"\nonebit_warmup = 7\nmesh = "fsdp=2,cp=2"\n')
    with pytest.raises(ValueError, match="--mesh has cp=2: use a mesh of dp and fsdp only"):
        load_config(["--config", str(path)]).validate(4)
