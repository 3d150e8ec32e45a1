"""Data: the loader cuts deterministic batches out of a corpus's token stream (launch.stream builds it).

Batches. Step k's global batch is B windows of T+1 tokens whose start offsets are drawn by
`numpy.random.default_rng([seed, k])` - a function of (seed, k) alone, whatever the mesh. Row i is
`stream[s_i : s_i + T + 1]`; tokens are its first T ids, targets the last T. With R data-parallel ranks
and K accumulation micro-batches, data-parallel rank r owns rows [r*B/R, (r+1)*B/R) and micro-batch j of
rank r is rows r*B/R + j*B/(R*K) ... r*B/R + (j+1)*B/(R*K) - 1, i.e. the rank's slice cut in K
consecutive pieces. Ranks that differ only in tp/pp coordinates have the same data-parallel rank and so
identical batches; so do ranks that differ only in cp, and `model_inputs` then gives each its zigzag share
of the sequence with the tokens' positions. The loader's position (`state_dict()`) is the next step number.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import spmd

from .stream import cache_dir, stdlib_files, text_files, token_stream
from .tokenizer import ByteTokenizer, load_tokenizer


class DataLoader:
    """This data-parallel rank's micro-batches, step by step (see the module docstring for the order).

    `next()` returns the K = grad_accum micro-batches of the next step, each (tokens, targets) of shape
    [batch_size / (dp_size * K), seq_len], int64 on `device`.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum: int = 1,
        seed: int = 0,
        vocab_size: int | None = None,
        device="cpu",
        fingerprint: str = "",
    ):
        if batch_size % (dp_size * grad_accum):
            raise ValueError(f"batch size {batch_size} must divide by dp_size*grad_accum = {dp_size * grad_accum}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
                f"use more data or a shorter --seq-len"
            )
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.rank, self.R, self.K = dp_rank, dp_size, grad_accum
        self.seed, self.vocab_size, self.device = seed, vocab_size, device
        self.fingerprint = fingerprint
        self.step = 0

    def starts(self, step: int) -> np.ndarray:
        """Start offsets of the B rows of the global batch at `step`."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.T - 1, size=self.B, endpoint=True)

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) of the global batch at `step` as (tokens, targets)."""
        starts = self.starts(step)[lo:hi]
        idx = starts[:, None] + np.arange(self.T + 1)[None, :]
        window = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        if self.vocab_size is not None and window.numel():
            top = int(window.max())
            if top >= self.vocab_size:
                raise ValueError(
                    f"the data holds token id {top} but the model's vocabulary has {self.vocab_size} "
                    f"entries; tokenise with a tokenizer that fits the model (or a model whose "
                    f"vocab_size covers it)"
                )
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole [B, T] batch of `step` (for single-process references)."""
        return self.rows(step, 0, self.B)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_rank, per_micro = self.B // self.R, self.B // (self.R * self.K)
        base = self.rank * per_rank
        x, y = self.rows(step, base, base + per_rank)
        return [(x[j * per_micro : (j + 1) * per_micro], y[j * per_micro : (j + 1) * per_micro]) for j in range(self.K)]

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = self.micro_batches(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "fingerprint": self.fingerprint, "tokens": int(len(self.tokens))}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's data seed is {state['seed']} but --seed is {self.seed}; "
                f"resume with --seed {state['seed']} to continue the same data order"
            )
        if state.get("fingerprint") and self.fingerprint and state["fingerprint"] != self.fingerprint:
            print(
                f"warning: the corpus differs from the one the checkpoint was trained on "
                f"({state['fingerprint']} vs {self.fingerprint}); continuing at step {state['step']} "
                f"on the new data",
                file=sys.stderr,
            )
        self.step = int(state["step"])


def build_loader(cfg, dp_rank: int, dp_size: int, vocab_size: int, device="cpu") -> tuple[DataLoader, object]:
    """(loader, tokenizer) for a TrainConfig."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"--tokenizer {cfg.tokenizer} has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary has {vocab_size}; use a model preset with a larger vocab_size (for "
            f"--model hf:DIR, vocab_size in DIR/config.json), or a --tokenizer with fewer tokens"
        )
    tokens, fingerprint = token_stream(cfg.data, tokenizer, cfg.data_field)
    loader = DataLoader(
        tokens,
        cfg.batch_size,
        cfg.seq_len,
        dp_rank,
        dp_size,
        cfg.grad_accum,
        cfg.seed,
        vocab_size=vocab_size,
        device=device,
        fingerprint=fingerprint,
    )
    return loader, tokenizer


__all__ = [
    "ByteTokenizer",
    "DataLoader",
    "build_loader",
    "token_stream",
    "stdlib_files",
    "text_files",
    "cache_dir",
    "load_tokenizer",
]


def model_inputs(tokens: torch.Tensor, targets: torch.Tensor, mesh) -> tuple:
    """The model's arguments for one micro-batch: (tokens, targets), or under context parallelism this cp
    rank's zigzag share of them and of their positions, which RoPE rotates by (spmd.cp_slice)."""
    if mesh is None or "cp" not in mesh.mesh_dim_names or mesh.size(mesh.mesh_dim_names.index("cp")) == 1:
        return tokens, targets
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return tuple(spmd.cp_slice(t, mesh) for t in (tokens, targets, positions))
