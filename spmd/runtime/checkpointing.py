"""Activation checkpointing of the repeated blocks: `none`, `full` (every block), `selective:N` (every
N-th block). Recomputation runs under torch's non-reentrant checkpoint; it regathers FSDP parameters
and replays the block's layout moves, so gradients are the same as without it."""
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..layout.blocks import find_blocks
from .reshard import CHECKPOINTED_ATTR
from .state import STATE_ATTR, activated

__all__ = ["apply_activation_checkpointing", "checkpoint_block", "parse_mode"]


def parse_mode(mode: str) -> int:
    """0 for none, N for every N-th block (full is 1)."""
    if mode in ("none", "", None):
        return 0
    if mode == "full":
        return 1
    if mode.startswith("selective:"):
        try:
            n = int(mode.split(":", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return n
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
    forward = block.forward

    def run(*args, **kwargs):
        with activated(getattr(root, STATE_ATTR, None)):
            return forward(*args, **kwargs)

    def checkpointed(*args, **kwargs):
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed
    for m in block.modules():
        setattr(m, CHECKPOINTED_ATTR, True)
