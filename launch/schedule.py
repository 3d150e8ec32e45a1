"""Learning-rate schedule: linear warmup to the peak, then cosine decay to 10% of the peak at the last step.

`lr_at(step, ...)` is a pure function of the 0-based optimizer step about to be taken, so a resumed run
sets exactly the learning rate an uninterrupted one would; `scheduler(optimizer, ...)` wraps it in a
`torch.optim.lr_scheduler.LambdaLR` for those who prefer one.
"""

import math

import torch

MIN_RATIO = 0.1


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float = MIN_RATIO) -> float:
    """Step 0..warmup-1: peak*(step+1)/warmup. Then cosine from peak (at step=warmup) to min_ratio*peak
    (at step=total-1); steps past the end stay at min_ratio*peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:  # a group with its own peak (spmd.Muon's matrices) keeps the ratio
        group["lr"] = lr * group.get("lr_scale", 1.0)


def scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float = MIN_RATIO):
    """LambdaLR over the optimizer's initial lr as the peak."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, 1.0, warmup, total, min_ratio))
