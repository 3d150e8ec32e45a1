"""launch.train's validation (launch/validate.py): the held-out loss of fsdp x tp x sp, pipeline and context
parallel runs equals plain PyTorch evaluating the same checkpoint on the same tokens; evaluating does not
change training; the held-out split is disjoint from every window training reads; rows, plot and refusals.

One 4-process gloo launch trains the three specs one after the other (the trainer joins the launch's
process group); the one-process references run in the test process.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

import launch.train as T
from launch import plot
from launch.config import load_config
from launch.data import token_stream
from launch.metrics import MetricsLogger
from launch.tokenizer import ByteTokenizer
from launch.validate import Validator, build_loaders
from models.llama import Llama, LlamaConfig
from spmd import checkpoint

pytestmark = pytest.mark.usefixtures("isolated_trainer")

B, S, K = 8, 64, 2  # batch, sequence length, validation batches
COMMON = [
    "--batch-size",
    str(B),
    "--seq-len",
    str(S),
    "--warmup",
    "3",
    "--lr",
    "3e-3",
    "--steps",
    "2",
    "--val-batches",
    str(K),
]
SPECS = {
    "fsdp2_tp2_sp": ["--mesh", "fsdp=2,tp=2,sp", "--grad-accum", "2"],
    "pp2_fsdp2": ["--mesh", "pp=2,fsdp=2", "--pp-schedule", "1f1b", "--microbatches", "2"],
    "fsdp2_cp2": ["--mesh", "fsdp=2,cp=2"],
}


@pytest.fixture
def corpus(tmp_path):
    """60 kB of text with some structure to learn (byte tokens)."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "None", "x", "y", "(", ")", ":"]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 15_000)))
    return path


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _plain_val_loss(ckpt: Path, corpus: Path) -> float:
    """One process, plain PyTorch: the checkpoint's weights in a Llama, its mean cross-entropy over the K*B
    windows of the stream's tail (the last max(1%, K*B*S + 1) tokens), all in one batch."""
    model = Llama(LlamaConfig.preset("tiny"))
    checkpoint.load(ckpt, checkpoint.model_state(model), strict=False)
    tokens = np.asarray(token_stream(str(corpus), ByteTokenizer())[0], dtype=np.int64)
    tail = tokens[len(tokens) - max(math.ceil(len(tokens) / 100), K * B * S + 1) :]
    windows = torch.from_numpy(np.stack([tail[i * S : i * S + S + 1] for i in range(K * B)]))
    model.eval()
    with torch.no_grad():
        return float(model(windows[:, :-1], windows[:, 1:]))


def _train_specs(rank, world, corpus, root):
    T.peak_flops = lambda dtype, device: (1e11, "test")  # the workers do not see the test's monkeypatch
    for name, flags in SPECS.items():
        T.train(
            load_config(
                [
                    *COMMON,
                    *flags,
                    "--data",
                    corpus,
                    "--val-every",
                    "1",
                    "--metrics",
                    f"{root}/{name}.jsonl",
                    "--ckpt-dir",
                    f"{root}/{name}",
                ]
            ),
            log=False,
        )


@pytest.mark.slow
def test_validation_on_every_spec_equals_plain_pytorch_and_leaves_training_alone(tmp_path, corpus):
    """Each spec validates after steps 1 and 2 (--val-every 1); its val_loss after step 2 equals plain PyTorch
    on its step-2 checkpoint within 1e-6 (relative), and its training losses and that val_loss equal one
    process validating only after the last step (rel 1e-5): the validation after step 1 changed nothing.
    Mutations seen failing: every data-parallel rank evaluating rank 0's rows (ValSet.micro_batches with
    `self.rank` -> 0: val_loss off by 2e-4 on fsdp2_tp2_sp, the first checked, and rows differ in
    test_held_out_split_is_disjoint_from_training); the pipeline evaluating with `pipe.step`
    (forward and backward: gradients leak into step 2's update, and its val_loss moves by 7e-3)."""
    run_distributed(_train_specs, 4, str(corpus), str(tmp_path), timeout_s=600)
    ref = T.train(
        load_config([*COMMON, "--data", str(corpus), "--val-every", "100", "--ckpt-dir", str(tmp_path / "one")]),
        log=False,
    )
    assert [("val_loss" in r) for r in ref] == [False, True]
    assert ref[-1]["val_loss"] == pytest.approx(_plain_val_loss(tmp_path / "one", corpus), rel=1e-6)
    for name in SPECS:
        rows = _jsonl(tmp_path / f"{name}.jsonl")
        assert [r["step"] for r in rows] == [1, 2]
        assert all(set(r) >= {"val_loss", "val_perplexity"} for r in rows), name
        assert rows[1]["val_perplexity"] == pytest.approx(math.exp(rows[1]["val_loss"]), rel=1e-12)
        assert rows[1]["val_loss"] == pytest.approx(_plain_val_loss(tmp_path / name, corpus), rel=1e-6), name
        for a, b in zip(ref, rows):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, b["step"])
        assert rows[1]["val_loss"] == pytest.approx(ref[1]["val_loss"], rel=1e-5), name  # step 2 updated alike
        assert rows[0]["val_loss"] > rows[1]["val_loss"]  # it learns: the held-out loss falls


def test_held_out_split_is_disjoint_from_training(corpus):
    """Every window the training loader cuts (200 steps, both data-parallel ranks) ends before the split,
    which is the stream's last max(1%, K*B*S + 1) tokens; the validation rows of the ranks are the split's
    consecutive windows in order; with --val-data training reads the whole --data.
    Mutation seen failing: build_loaders training on the whole stream (`head` = the loader as built: the
    length and the window ends pass the split)."""
    cfg = load_config([*COMMON, "--data", str(corpus), "--val-every", "1"])
    n = len(token_stream(str(corpus), ByteTokenizer())[0])
    lo = n - max(math.ceil(n / 100), K * B * S + 1)
    ranks = [build_loaders(cfg, r, 2, 512) for r in range(2)]
    loader, val = ranks[0][0], ranks[0][2]
    assert len(loader.tokens) == lo and val.offset == lo and len(val.tokens) == n - lo
    ends = np.concatenate([loader.starts(step) for step in range(200)]) + S + 1  # one past each window's last
    assert ends.max() <= lo and ends.max() > lo - 50  # training reads the head up to the split, not past it
    stream = np.asarray(token_stream(str(corpus), ByteTokenizer())[0], dtype=np.int64)
    for k in range(K):
        rows = torch.cat([v.micro_batches(k)[0][0] for _, _, v in ranks])  # rank 0's rows, then rank 1's
        expect = np.stack([stream[lo + (k * B + i) * S : lo + (k * B + i) * S + S] for i in range(B)])
        assert torch.equal(rows, torch.from_numpy(expect))
    apart = load_config([*COMMON, "--data", str(corpus), "--val-every", "1", "--val-data", str(corpus)])
    loader, _, val = build_loaders(apart, 0, 1, 512)
    assert len(loader.tokens) == n and val.offset == 0


def test_rows_of_validation_steps_are_written_and_plotted(tmp_path, corpus):
    """Validation runs after every --val-every-th step and after the last; its row is written even where
    --log-every skips the step, and TensorBoard and W&B get it as val_loss/val_perplexity at that step;
    launch.plot draws the val curve on the loss panel at those steps.
    Mutation seen failing: metrics._tag giving val_loss the training prefix (train/val_loss)."""
    cfg = load_config([*COMMON, "--data", str(corpus), "--val-every", "2", "--steps", "5"])
    validator = Validator(cfg, build_loaders(cfg, 0, 1, 512)[2], None, None, None, 1)
    assert [s for s in range(1, 6) if validator.due(s)] == [2, 4, 5]
    out = tmp_path / "run.jsonl"
    log = MetricsLogger(5, 64, 10, 1e9, 1, jsonl=str(out), log_every=2, console=False)
    logged = []  # what TensorBoard's add_scalar and W&B's log receive: (tag, step)
    log.tb = type(
        "Writer", (), {"add_scalar": lambda _, tag, v, step: logged.append(("tb", tag, step)), "close": lambda _: None}
    )()
    log.wandb = type(
        "Run",
        (),
        {"log": lambda _, row, step: logged.extend(("wandb", k, step) for k in row), "finish": lambda _: None},
    )()
    for step in range(1, 6):
        val = {"val_loss": 4.0 - step / 2, "val_perplexity": math.exp(4.0 - step / 2)} if step in (3, 5) else {}
        log.record(step, 5.0 - step / 2, 1.0, 1e-3, 0.1, 0, 0, extra=val)
    log.close()
    assert [(r["step"], "val_loss" in r) for r in _jsonl(out)] == [(2, False), (3, True), (4, False), (5, True)]
    for sink in ("tb", "wandb"):
        assert [(tag, step) for s, tag, step in logged if s == sink and tag.startswith("val")] == [
            ("val_loss", 3),
            ("val_perplexity", 3),
            ("val_loss", 5),
            ("val_perplexity", 5),
        ]
        assert (sink, "train/loss", 3) in logged
    fig = plot.draw({"run.jsonl": plot.read_metrics(out)})
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["run.jsonl", "run.jsonl val"]
    assert list(lines[1].get_xdata()) == [3, 5] and list(lines[1].get_ydata()) == [2.5, 1.5]
    assert [line.get_label() for line in fig.axes[1].get_lines()] == ["run.jsonl"]


def test_bad_values_are_refused_with_the_fix(tmp_path, corpus):
    for flags, message in [
        (["--val-every", "-1"], "--val-every must be >= 0"),
        (["--val-every", "1", "--val-batches", "0"], "--val-batches must be >= 1"),
        (["--val-data", str(corpus)], "is never read without --val-every N; add --val-every"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(flags).validate(1)
    toml = tmp_path / "v.toml"
    toml.write_text('val_every = 5\nval_batches = 3\nval_data = "held.txt"\n')
    cfg = load_config(["--config", str(toml)])
    assert (cfg.val_every, cfg.val_batches, cfg.val_data) == (5, 3, "held.txt")
    toml.write_text('val_every = "often"\n')
    with pytest.raises(ValueError, match="val_every = 'often' should be a int"):
        load_config(["--config", str(toml)])
    too_many = ["--data", str(corpus), "--val-every", "1", "--val-batches", "200"]
    with pytest.raises(ValueError, match="would leave training less than half; use fewer --val-batches"):
        build_loaders(load_config([*COMMON, *too_many]), 0, 1, 512)
    with pytest.raises(ValueError, match="--val-batches 200 of --batch-size 8 x --seq-len 64 need 102,401"):
        build_loaders(load_config([*COMMON, *too_many, "--val-data", str(corpus)]), 0, 1, 512)
    with pytest.raises(ValueError, match="--val-data: --data .* matches no files"):
        build_loaders(load_config([*COMMON, "--val-every", "1", "--val-data", str(tmp_path / "none*.txt")]), 0, 1, 512)
