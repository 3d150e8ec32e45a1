"""`python -m spmd.explain` prints exactly `plan.table()` of the same arguments and writes the plan as JSON;
`--ac` plans activation checkpointing as the trainer applies it (tests/test_plan_matches_run.py holds that plan
against a real checkpointed step); bad arguments are one-line errors."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
import spmd

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--model", "tiny", "--mesh", "fsdp=2,tp=2,sp", "--batch", "8", "--seq", "16", "--dtype", "fp32"]


def _plan(sizes, ac="none", sp=True):
    with torch.device("meta"):
        model = models.preset("tiny").build()
    return spmd.explain(
        model, spmd.Rules.default(sequence_parallel=sp), sizes, batch_shape=(8, 16), dtype=torch.float32, ac=ac
    )


def test_cli_prints_the_plan_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-m", "spmd.explain", *ARGS, "--ac", "full", "--json", str(tmp_path / "plan.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0 and not out.stderr, out.stderr  # no runpy warning either
    plan = _plan({"fsdp": 2, "tp": 2}, ac="full")
    assert out.stdout == plan.table() + "\n"
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(plan.to_json())


def test_the_trainers_config_with_muon_plans_muons_exchanges(tmp_path, capsys):
    """launch.train's TOML with `optimizer = "muon"` (its --optimizer muon) makes the command plan spmd.Muon's
    step: the table of spmd.explain(optimizer="muon"), whose two all-to-alls (held against a real step in
    tests/test_muon.py) add to the step's total (mutation: explain ignoring `optimizer` fails here)."""
    from spmd.cli import explain_main

    config = tmp_path / "train.toml"
    config.write_text(
        'model = "tiny"\nmesh = "fsdp=4"\nbatch_size = 8\nseq_len = 16\ndtype = "fp32"\noptimizer = "muon"\n'
    )
    assert explain_main(["--config", str(config)]) == 0
    with torch.device("meta"):
        model = models.preset("tiny").build()
    plan = spmd.explain(model, spmd.Rules.default(), {"fsdp": 4}, batch_shape=(8, 16), optimizer="muon")
    assert capsys.readouterr().out == plan.table() + "\n"
    rows = [c for c in plan.collectives if c.op.startswith("spmd.optim.whole_matrix")]
    assert [(c.kind, c.phase) for c in rows] == [("all_to_all", "optimizer")] * 2
    adamw = _plan({"fsdp": 4}, sp=False)
    assert plan.comm_bytes() == adamw.comm_bytes() + sum(c.bytes for c in rows)  # tiny's ranks move alike
    assert plan.memory["optimizer"] < adamw.memory["optimizer"]  # one momentum per matrix, not two moments


def test_ac_keeps_block_inputs_only_and_replays_the_forward():
    def replayed(plan):  # forward layout moves issued again while backward recomputes the blocks
        return [c for c in plan.collectives if c.phase == "backward" and c.reason.startswith("move input")]

    for sizes in ({"fsdp": 2, "tp": 2}, {"pp": 2, "fsdp": 2}):
        plain, full = _plan(sizes), _plan(sizes, ac="full")
        assert full.memory["activations"] < plain.memory["activations"] / 2, sizes
        if "tp" in sizes:
            assert len(replayed(full)) == 4 and not replayed(plain)  # wq's and w1's input, 2 blocks


def test_bad_arguments_are_one_line_errors(capsys):
    from spmd.cli import explain_main as main

    for argv, message in [
        (["--mesh", "fsdp=x"], "mesh axis size must be an integer"),
        (["--model", "nope"], "unknown model preset 'nope'"),
        (["--ac", "bogus"], "activation checkpointing mode must be"),
        (["--registry", "no_such_registry"], "--registry 'no_such_registry' cannot be imported"),
        (["--optimizer", "lion"], "optimizer 'lion' is not one explain plans; use one of adamw"),
        (["--optimizer", "muon", "--mesh", "pp=2,fsdp=2"], "plan it on a mesh without pp and without offload"),
    ]:
        assert main([*ARGS, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("spmd.explain: error: ") and message in err and err.count("\n") == 1, err
    assert callable(spmd.explain)  # the command leaves spmd.explain usable
    with pytest.raises(ImportError, match="is a command"):  # the command's module is a script, never imported
        importlib.import_module("spmd.explain")
    assert callable(spmd.explain) and callable(spmd.search)


def test_explain_and_search_take_a_local_hugging_face_directory(tmp_path, capsys):
    """`--model hf:DIR` (a tiny LlamaForCausalLM's config.json, nothing downloaded): each command prints exactly
    the table of the same call made in code; a directory without config.json is a one-line error."""
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "llama"
    transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(hf_dir)
    from spmd.cli import explain_main
    from spmd.search_command import search_main

    assert (
        explain_main(
            ["--model", f"hf:{hf_dir}", "--mesh", "fsdp=2,tp=2,sp", "--batch", "4", "--seq", "16", "--dtype", "fp32"]
        )
        == 0
    )
    with torch.device("meta"):
        model = models.preset(f"hf:{hf_dir}").build()
    plan = spmd.explain(
        model,
        spmd.Rules.default(sequence_parallel=True),
        {"fsdp": 2, "tp": 2},
        batch_shape=(4, 16),
        dtype=torch.float32,
    )
    assert capsys.readouterr().out == plan.table() + "\n"
    assert "model.layers.*.self_attn.q_proj" in plan.table()  # transformers' own module names

    assert (
        search_main(
            [
                "--model",
                f"hf:{hf_dir}",
                "--world",
                "2",
                "--device",
                "a100",
                "--batch",
                "4",
                "--seq",
                "16",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    ranked = spmd.search(models.preset(f"hf:{hf_dir}"), 2, device="a100", batch_shape=(4, 16), workers=1)
    out = capsys.readouterr().out
    assert out == ranked.table() + "\n" and "TransformersConfig(layers=2," in out
    assert sorted({r.spec for r in ranked}) == ["dp=2", "fsdp=2", "tp=2", "tp=2,sp"]

    for main in (explain_main, search_main):
        assert main(["--model", f"hf:{tmp_path / 'empty'}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no config.json; --model hf:DIR takes a local Hugging Face" in err
