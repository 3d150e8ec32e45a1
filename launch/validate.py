"""Validation: a held-out loss and perplexity during training (`--val-every N`, `--val-batches K`, `--val-data`).

The validation set is a token stream cut into consecutive windows of T+1 tokens that overlap by one (window
i is `val[i*T : i*T + T + 1]`, so every token but the first is predicted exactly once); batch k holds windows
k*B ... k*B + B - 1, and every evaluation reads the same K batches, so the curve compares like with like.
Each batch is cut over the data-parallel ranks and into --grad-accum micro-batches as a training batch is
(launch/data.py), and under cp `model_inputs` gives each rank its share of the sequence.

Where it comes from: `--val-data` (any `--data` format, the same tokenizer), or by default the tail of the
training stream, which training then never reads: the last `held_out_tokens(n, B, T, K)` tokens, 1% of the
stream or the K batches' K*B*T + 1 tokens if that is more (stdlib: 121,194 of 12.1M tokens). The training
loader draws its windows from the head alone, so no training window reaches into the held-out tail.

The loss is the mean over every validation token of every rank: the model's loss on a mesh is the mean over
all data-parallel ranks' tokens (spmd's vocab-parallel cross-entropy sums the loss and the count over them),
and batches are weighed by their token counts. Evaluation runs the model in eval mode under no_grad; a
pipeline runs its schedule's forwards only (`Pipeline.evaluate`).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from spmd.layout.dtypes import DTYPES

from .data import DataLoader, build_loader, model_inputs, token_stream

HELD_OUT_FRACTION = 0.01

__all__ = ["HELD_OUT_FRACTION", "ValSet", "Validator", "build_loaders", "evaluate", "held_out_tokens"]


def held_out_tokens(n_tokens: int, batch_size: int, seq_len: int, val_batches: int) -> int:
    """How many tokens at the end of an `n_tokens` stream the default validation split holds."""
    return max(math.ceil(n_tokens * HELD_OUT_FRACTION), val_batches * batch_size * seq_len + 1)


class ValSet:
    """The K validation batches of a token stream, this data-parallel rank's micro-batches of each."""

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        val_batches: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum: int = 1,
        device="cpu",
        offset: int = 0,
        source: str = "",
    ):
        need = val_batches * batch_size * seq_len + 1
        if len(tokens) < need:
            raise ValueError(
                f"{source or 'the validation data'} holds {len(tokens):,} tokens but --val-batches "
                f"{val_batches} of --batch-size {batch_size} x --seq-len {seq_len} need {need:,}; "
                f"use fewer --val-batches or more validation data"
            )
        self.tokens, self.B, self.T, self.K = tokens, batch_size, seq_len, val_batches
        self.rank, self.R, self.accum, self.device = dp_rank, dp_size, grad_accum, device
        self.offset = offset  # where `tokens` starts in the stream it was cut from (for reports and tests)

    def window_starts(self, batch: int) -> np.ndarray:
        """Start offsets (in `tokens`) of the B windows of validation batch `batch`."""
        return (batch * self.B + np.arange(self.B)) * self.T

    def micro_batches(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows of batch `batch` as (tokens, targets) micro-batches, cut as training cuts them."""
        per_rank, per_micro = self.B // self.R, self.B // (self.R * self.accum)
        starts = self.window_starts(batch)[self.rank * per_rank : (self.rank + 1) * per_rank]
        window = torch.from_numpy(np.asarray(self.tokens[starts[:, None] + np.arange(self.T + 1)], dtype=np.int64))
        x, y = window[:, :-1].to(self.device), window[:, 1:].to(self.device)
        return [
            (x[j * per_micro : (j + 1) * per_micro], y[j * per_micro : (j + 1) * per_micro]) for j in range(self.accum)
        ]


def build_loaders(cfg, dp_rank: int, dp_size: int, vocab_size: int, device="cpu"):
    """(training loader, tokenizer, ValSet or None). Without --val-data the training loader reads the
    stream's head only and the ValSet its held-out tail."""
    loader, tokenizer = build_loader(cfg, dp_rank, dp_size, vocab_size, device)
    if not cfg.val_every:
        return loader, tokenizer, None
    common = {"dp_rank": dp_rank, "dp_size": dp_size, "grad_accum": cfg.grad_accum, "device": device}
    if cfg.val_data:
        try:
            tokens, _ = token_stream(cfg.val_data, tokenizer, cfg.data_field)
        except ValueError as e:
            raise ValueError(f"--val-data: {e}") from None
        read = tokens[: cfg.val_batches * cfg.batch_size * cfg.seq_len + 1]  # what validation reads
        if len(read) and int(read.max()) >= vocab_size:
            raise ValueError(
                f"--val-data holds token id {int(read.max())} but the model's vocabulary has "
                f"{vocab_size} entries; tokenise it with --tokenizer {cfg.tokenizer}"
            )
        return (
            loader,
            tokenizer,
            ValSet(tokens, cfg.batch_size, cfg.seq_len, cfg.val_batches, **common, source=f"--val-data {cfg.val_data}"),
        )
    n = len(loader.tokens)
    lo = n - held_out_tokens(n, cfg.batch_size, cfg.seq_len, cfg.val_batches)
    if lo < n // 2:
        raise ValueError(
            f"--data {cfg.data} holds {n:,} tokens; holding out --val-batches {cfg.val_batches} of "
            f"{cfg.batch_size}x{cfg.seq_len} tokens would leave training less than half; use fewer "
            f"--val-batches, a smaller --batch-size, more data, or a separate --val-data"
        )
    head = DataLoader(
        loader.tokens[:lo],
        cfg.batch_size,
        cfg.seq_len,
        dp_rank,
        dp_size,
        cfg.grad_accum,
        cfg.seed,
        vocab_size=vocab_size,
        device=device,
        fingerprint=f"{loader.fingerprint}:head{lo}",
    )
    return (
        head,
        tokenizer,
        ValSet(
            loader.tokens[lo:],
            cfg.batch_size,
            cfg.seq_len,
            cfg.val_batches,
            **common,
            offset=lo,
            source=f"the held-out split of --data {cfg.data}",
        ),
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def evaluate(model, val: ValSet, mesh=None, pipe=None, amp_dtype: torch.dtype | None = None) -> float:
    """The mean loss over every token of the K validation batches (all ranks'), the same on every rank.
    `model` is the laid-out model (a pipeline's `module` with `pipe`); `amp_dtype` autocasts one process."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for k in range(val.K):
                for x, y in val.micro_batches(k):
                    inputs = model_inputs(x, y, mesh)
                    if pipe is not None:
                        loss = pipe.evaluate(*inputs[:2], positions=inputs[2] if len(inputs) > 2 else None)
                    else:
                        amp = torch.autocast(x.device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
                        with amp:
                            loss = model(*inputs)
                    tokens = x.numel() * val.R  # the micro-batch's tokens over every data-parallel rank
                    total += float(_full(loss)) * tokens
                    count += tokens
    finally:
        model.train(was_training)
    return total / count


class Validator:
    """When to evaluate (every `--val-every` steps and after the last) and the metrics it adds to a row."""

    def __init__(self, cfg, val: ValSet | None, model, mesh, pipe, world: int, say=None):
        self.val, self.model, self.mesh, self.pipe = val, model, mesh, pipe
        self.every, self.last = cfg.val_every, cfg.steps
        self.amp = DTYPES[cfg.dtype] if world == 1 and cfg.dtype != "fp32" else None
        self.say = say or (lambda message: None)
        self.say(f"[launch.train] {self.describe(cfg.data)}")

    def describe(self, data: str) -> str:
        if self.val is None:
            return "validation off (--val-every 0)"
        where = (
            f"the last {len(self.val.tokens):,} tokens of --data {data} (never read by training)"
            if self.val.offset
            else "--val-data"
        )
        return (
            f"validation every {self.every} steps and after the last: {self.val.K} batch(es) of "
            f"{self.val.B}x{self.val.T} tokens from {where}"
        )

    def due(self, step: int) -> bool:
        return self.val is not None and (step % self.every == 0 or step == self.last)

    def metrics(self, step: int) -> dict:
        """{"val_loss", "val_perplexity"} when validation is due after `step` (collective), else {}."""
        if not self.due(step):
            return {}
        loss = evaluate(self.model, self.val, self.mesh, self.pipe, self.amp)
        row = {"val_loss": loss, "val_perplexity": math.exp(loss) if loss < 700 else math.inf}
        self.say(f"[launch.train] step {step}: val_loss {loss:.4f}, val_perplexity {row['val_perplexity']:.2f}")
        return row
