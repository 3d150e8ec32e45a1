"""Rules as data: the [rules.*] tables of a TOML config give the trainer, `spmd.explain` and `spmd.search` their
layout; a table that spells out the default is Rules.default exactly, a custom one changes the layout and the
plan, and a bad one is an error naming the key and the fix before anything is built."""

import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import launch.train as T
from launch.config import load_config
from spmd.cli import explain_parser, parse_args, plan_from_args
from spmd.layout.rules import Rules
from spmd.layout.rules_table import ordered_maps
from spmd.search_command import search_main

SHIPPED = Path(__file__).resolve().parents[1] / "launch" / "configs" / "tiny_rules.toml"
# the default's compute map with mlp left out: the MLP computes whole on every tp rank
NO_MLP = """
[rules.compute]
batch = ["dp", "fsdp", "ep"]
vocab = "tp"
heads = "tp"
kv_heads = "tp"
experts = "ep"
seq = "cp"
[rules.params]
embed = "fsdp"
"""


def _toml(tmp_path, text, name="rules.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_table_spelling_out_the_default_is_the_default(tmp_path):
    """Mutation killed: merging a later map without the one before it (grads/optimizer lose `embed`)."""
    cfg = load_config(["--config", str(SHIPPED)])
    assert ordered_maps(cfg.rules()) == ordered_maps(Rules.default(sequence_parallel=True, zero=3))
    assert (cfg.zero, cfg.sp, cfg.sequence_parallel()) == (3, True, True)
    zero1 = _toml(
        tmp_path,
        NO_MLP.replace("[rules.params]", "[rules.optimizer]").replace('experts = "ep"', 'mlp = "tp"\nexperts = "ep"'),
    )
    cfg = load_config(["--config", zero1])
    assert ordered_maps(cfg.rules()) == ordered_maps(Rules.default(zero=1)) and (cfg.zero, cfg.sp) == (1, False)


BAD = {
    "unknown mesh axis": (
        '[rules.compute]\nmlp = "tpp"\n',
        [],
        "[rules] compute rule 'mlp' names mesh axis 'tpp'",
        "did you mean 'tp'?",
    ),
    "wrong type": (
        "[rules.compute]\nmlp = 2\n",
        [],
        "[rules.compute] mlp = 2: a rule is a mesh axis or a list",
        'mlp = "tp"',
    ),
    "unknown map": (
        '[rules.compute]\nmlp = "tp"\n[rules.param]\nembed = "fsdp"\n',
        [],
        "[rules.param] is not a map of the rules",
        "[rules.params]",
    ),
    "grads drop sharding": (
        NO_MLP + "[rules.grads]\nembed = []\n",
        [],
        "grads rule 'embed': () drops mesh axes ('fsdp',)",
        "may only add sharding to the one before",
    ),
    "zero flag": (
        NO_MLP,
        ["--zero", "1"],
        "its [rules] tables make ZeRO stage 3 but --zero 1 was given",
        "leave --zero out",
    ),
    "sp in mesh": (
        NO_MLP,
        ["--mesh", "fsdp=2,tp=2,sp"],
        "sequence parallelism is in the [rules.compute] table",
        "drop the flag or change seq",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_table_names_the_key_and_the_fix_before_anything_runs(tmp_path, capsys, case):
    """Through launch.train's main: status 2 and the message, with no process group ever started."""
    text, flags, problem, fix = BAD[case]
    path = _toml(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_config(["--config", path, *flags])
    assert problem in str(e.value) and fix in str(e.value) and f"config file {path}" in str(e.value)
    assert T.main(["--config", path, *flags]) == T.EXIT_BAD_INPUT
    assert problem in capsys.readouterr().err and not torch.distributed.is_initialized()


def _plan(*argv):
    return plan_from_args(parse_args(explain_parser(), list(argv), "spmd.explain"))


def test_explain_and_search_take_the_same_file(tmp_path, capsys):
    """Mutation killed: explain ignoring --config's tables (the MLP rows stay)."""
    custom = _toml(tmp_path, NO_MLP)
    flags = ["--model", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--dtype", "fp32"]
    default = [c for c in _plan(*flags).collectives if "feed_forward" in c.module and "tp" in c.axes]
    assert default, "the default's MLP is tp-sharded and reduces its partial sums"
    assert not [
        c for c in _plan("--config", custom, *flags).collectives if "feed_forward" in c.module and "tp" in c.axes
    ]
    # the shipped file's defaults (model tiny) and its tables (sp) reach explain; flags override them
    same = _plan("--config", str(SHIPPED), "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--dtype", "fp32")
    sp = _plan(*flags[:3], "tp=2,sp", *flags[4:])
    assert [(c.module, c.kind, c.bytes) for c in same.collectives] == [
        (c.module, c.kind, c.bytes) for c in sp.collectives
    ]
    assert search_main(["--config", custom, "--world", "2"]) == 2
    assert "spmd.search ranks meshes under Rules.default's tables" in capsys.readouterr().err


def _trainer_lays_out_the_table(rank, world, custom):
    from launch.setup import build_model

    for path, mlp in ((None, [Shard(0)]), (custom, [Replicate()])):
        cfg = load_config(["--mesh", "tp=2", "--batch-size", "2", *(["--config", path] if path else [])])
        model, *_ = build_model(cfg, cfg.model_config(), world, torch.device("cpu"))
        block = model.layers[0]
        assert list(block.feed_forward.w1.weight.placements) == mlp, (path, block.feed_forward.w1.weight.placements)
        assert list(block.attention.wq.weight.placements) == [Shard(0)]


@pytest.mark.slow
def test_the_trainer_applies_a_custom_table(tmp_path):
    """tp=2: under the default the MLP's w1 is split by rows over tp, under the table without mlp it is whole.
    Mutation killed: TrainConfig.rules() ignoring rules_table."""
    from dist_utils import run_distributed

    run_distributed(_trainer_lays_out_the_table, 2, _toml(tmp_path, NO_MLP))
