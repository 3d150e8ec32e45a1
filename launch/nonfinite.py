"""Steps with a non-finite loss or gradient norm: skipped (no optimizer step), counted, and a stop after
`limit` consecutive ones; and fp16's dynamic loss scaling, which answers an overflow by halving the scale.

The loss and the gradient norm the trainer passes are global values (reduced over every mesh axis), so
every rank takes the same decision without another collective. Under fp16 loss scaling a finite loss with an
inf/nan gradient norm is an overflow that the scaler answers by halving the scale: skipped and counted, but
it neither extends nor resets the run of bad steps.
"""

from __future__ import annotations

import math


class Diverged(RuntimeError):
    """`limit` consecutive steps were non-finite; the last good state has been checkpointed."""


class BadSteps:
    def __init__(self, limit: int, loss_scaling: bool = False):
        self.limit, self.loss_scaling = limit, loss_scaling
        self.skipped = 0  # steps skipped over the whole run
        self.streak = 0  # consecutive bad steps up to now
        self.last_good = 0  # the last step whose update was applied (0: none yet)

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when step `step`'s update may be applied."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak, self.last_good = 0, step
            return True
        self.skipped += 1
        if not (self.loss_scaling and math.isfinite(loss)):
            self.streak += 1
        return False

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.streak >= self.limit

    def message(self, step: int, saved: str | None) -> str:
        return (
            f"steps {step - self.streak + 1}..{step} had a non-finite loss or gradient norm "
            f"({self.streak} in a row, --max-bad-steps {self.limit}); training stopped. The parameters and "
            f"optimizer state are those after step {self.last_good}, the last good step"
            + (
                f", saved in {saved} (resuming continues after the skipped batches)"
                if saved
                else " (no --ckpt-dir: nothing saved)"
            )
            + ". Fix: lower --lr or --max-grad-norm, use --dtype fp32 or bf16 instead of fp16, or look for "
            "bad data in those steps"
        )

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "streak": self.streak, "last_good": self.last_good}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.skipped, self.streak, self.last_good = (
                int(state["skipped"]),
                int(state["streak"]),
                int(state["last_good"]),
            )


class LossScaler:
    """Dynamic loss scaling for fp16 (state is JSON, kept in checkpoint meta)."""

    def __init__(self, enabled: bool, scale: float = 2.0**16, interval: int = 1000):
        self.enabled, self.scale, self.interval, self.good = enabled, scale if enabled else 1.0, interval, 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = max(self.scale / 2, 1.0), 0
        else:
            self.good += 1
            if self.good % self.interval == 0:
                self.scale *= 2

    def state_dict(self):
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, s):
        if self.enabled and s:
            self.scale, self.good = float(s["scale"]), int(s["good"])
