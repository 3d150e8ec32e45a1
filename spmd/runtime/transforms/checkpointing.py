"""Activation checkpointing of the repeated blocks: `none`, `full` (every block), `selective:N` (every
N-th block). Recomputation runs under torch's non-reentrant checkpoint; it regathers FSDP parameters (a
bucketed block's as one bucket, as its forward did) and replays the block's layout moves, so gradients are
the same as without it."""

import contextlib
import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ...layout.blocks import find_blocks
from ..activations.global_view import GlobalView
from ..local.whole_model import drop_local_model
from ..parameters.gather import place_for_graph
from ..parameters.reshard import BODY_COMPILED_ATTR, CHECKPOINTED_ATTR
from ..state import STATE_ATTR, Phase, activated

__all__ = ["apply_activation_checkpointing", "checkpoint_block", "parse_mode"]


def parse_mode(mode: str) -> int:
    """0 for none, N for every N-th block (full is 1)."""
    if mode in ("none", "", None):
        return 0
    if mode == "full":
        return 1
    head, _, n = mode.partition(":")
    with contextlib.suppress(ValueError):  # (N not an int)
        if head == "selective" and int(n) >= 1:
            return int(n)
    raise ValueError(f"activation checkpointing mode must be none, full or selective:N with N >= 1, got {mode!r}")


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", blocks: str | None = None) -> list[int]:
    """Checkpoints blocks in place (parameter names do not change). Returns the indices checkpointed."""
    every = parse_mode(mode)
    if not every:
        return []
    _, block_list = find_blocks(model, blocks)
    chosen = [i for i in range(len(block_list)) if i % every == 0]
    for i in chosen:
        checkpoint_block(model, block_list[i])
    return chosen


def checkpoint_block(root: nn.Module, block: nn.Module):
    drop_local_model(root, getattr(root, STATE_ATTR, None))  # the recompute runs after the model's call ended
    block._spmd_body = block.forward  # what the checkpoint recomputes; compile_blocks compiles it

    def run(*args, **kwargs):
        state = getattr(root, STATE_ATTR, None)
        with activated(state), recomputing(state), _bucket_gathered(state, block):
            return block._spmd_body(*args, **kwargs)

    block.forward = functools.partial(checkpoint, run, use_reentrant=False)
    for m in block.modules():
        setattr(m, CHECKPOINTED_ATTR, True)


@contextlib.contextmanager
def recomputing(state):
    """The model's global view while a checkpointed block recomputes in backward (the root's has ended)."""
    if state is None or state.phase in (Phase.FORWARD, Phase.RECOMPUTE):
        yield
        return
    view = GlobalView(state)
    state.global_view.append((None, view, state.phase))
    state.phase = Phase.RECOMPUTE
    try:
        with view:
            yield
    finally:
        state.phase = state.global_view.pop()[2]


@contextlib.contextmanager
def _bucket_gathered(state, block: nn.Module):
    """While a bucketed block recomputes (its forward hook does not run again), its parameters gathered as
    one bucket instead of one by one; on the quantized wire also a compiled body's, for its graph to take."""
    body = getattr(block, BODY_COMPILED_ATTR, False)
    bucket = None if state is None or (body and state.wire is None) else state.groups.get(id(block))
    if bucket is None or bucket.values:  # forward: the hook gathered them
        yield
        return
    bucket.values = bucket.gather(state, why=f"regather {bucket.name} for recompute")
    if body:
        place_for_graph(block, bucket.values)
    try:
        yield
    finally:
        if body:
            place_for_graph(block, bucket.values, release=True)
        bucket.values = None
