"""launch.train on the mixture of experts: `--model moe-tiny --mesh fsdp=2,ep=2` on 4 processes trains step for
step as one process does (loss within 1e-5 relative, router load identical), its loss falls, its metrics
carry the router load, and its checkpoint loads in one process (ep=1) with the one-process run's logits."""

import pytest
import torch

import models
from spmd import checkpoint
from tests.test_train import SMALL, _jsonl, _train
from tests.train_ranks import train_on_ranks

pytestmark = pytest.mark.usefixtures("isolated_trainer")

STEPS = ["--model", "moe-tiny", "--steps", "4"]


def _logits(ckpt_dir, tokens):
    model = models.preset("moe-tiny").build()
    checkpoint.load(checkpoint.latest(ckpt_dir), checkpoint.model_state(model))
    with torch.no_grad():
        return model(tokens)


@pytest.mark.slow
def test_expert_parallel_run_trains_like_one_process_and_loads_at_ep1(tmp_path):
    one = _train(*STEPS, "--ckpt-dir", str(tmp_path / "one"))
    train_on_ranks(
        4,
        [
            *SMALL,
            *STEPS,
            "--mesh",
            "fsdp=2,ep=2",
            "--ckpt-dir",
            str(tmp_path / "ep"),
            "--metrics",
            str(tmp_path / "m.jsonl"),
        ],
    )
    rows = _jsonl(tmp_path / "m.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    tokens_per_step = 8 * 64 * models.preset("moe-tiny").top_k
    for a, b in zip(one, rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)
        assert b["tokens_per_expert"] == a["tokens_per_expert"]
        assert [sum(layer) for layer in b["tokens_per_expert"]] == [tokens_per_step] * 2
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, theirs = _logits(tmp_path / "ep", tokens), _logits(tmp_path / "one", tokens)
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-5
