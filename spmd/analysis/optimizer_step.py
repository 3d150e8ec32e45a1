"""The optimizer step of a dry run (explain, with or without pp): what spmd.shard_optimizer's step
communicates, recorded without updating anything."""

import torch

from ..runtime.optimizer.masters import gather_updated
from ..runtime.optimizer.shard import masters_of, reduce_gradients, shard_optimizer

__all__ = ["planning_optimizer", "record_optimizer_step"]


def planning_optimizer(model) -> torch.optim.Optimizer:
    """An AdamW on `model`'s parameters prepared by spmd.shard_optimizer, as the trainer's, before the first
    backward (from then on ZeRO-1's backward holds gradients for the step). Made outside the fake mode: the
    masters' offsets are then plain ints."""
    return shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=0.0))


def record_optimizer_step(model, opt, optimizer: str, recorder, fake) -> None:
    """What a sharded optimizer's step communicates: the reduce-scatters of the gradients ZeRO-1's backward
    left unreduced, and the all-gathers of updated shards into the parameters (none when every parameter is
    its own master, as under ZeRO-3). The update itself moves nothing and is not run."""
    with fake, recorder:
        reduce_gradients(model)
        if masters_of(opt) and optimizer in ("adam", "adamw"):
            gather_updated(opt)
