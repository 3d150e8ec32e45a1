"""The search's answer: one `Row` per spec (its predicted step, memory, the activation checkpointing and
micro-batches it assumes, as trainer flags) and the `SearchResult` table of them, with the model's label."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["Row", "SearchResult", "compression_note", "model_label"]


@dataclass
class Row:
    spec: str
    sizes: dict
    sp: bool
    zero: int | None = None  # ZeRO stage assumed (launch.train --zero); None: no fsdp axis, nothing to shard
    ac: str = "none"  # activation checkpointing assumed (launch.train --ac)
    grad_accum: int = 1  # micro-batches per step assumed (launch.train --grad-accum)
    step_s: float = math.nan
    compute_s: float = math.nan
    recompute_s: float = 0.0
    activation_comm_s: float = math.nan
    param_comm_s: float = math.nan
    hidden_s: float = 0.0
    schedule: str = ""  # pipeline schedule assumed (launch.train --pp-schedule); "" without pp
    microbatches: int = 0  # pipeline micro-batches per step (launch.train --microbatches)
    bubble_s: float = 0.0  # the schedule's idle time (spmd/analysis/search_pipeline.py)
    comm_bytes: int = 0
    collectives: int = 0
    bytes_by_axis: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    budget: float = math.nan
    fits: bool = True
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    note: str = ""

    @property
    def comm_s(self) -> float:
        return self.activation_comm_s + self.param_comm_s - self.hidden_s

    @property
    def flags(self) -> str:
        """The layout as launch.train's flags."""
        zero = "" if self.zero is None else f" --zero {self.zero}"
        pipe = f" --pp-schedule {self.schedule} --microbatches {self.microbatches}" if self.schedule else ""
        return f"--mesh {self.spec}{zero} --ac {self.ac} --grad-accum {self.grad_accum}{pipe}"

    def to_dict(self) -> dict:
        return {**asdict(self), "comm_s": self.comm_s, "flags": self.flags}


def compression_note(row: Row) -> str:
    """A note offering the quantized wire (docs/compression.md) to a spec whose predicted step is bound by
    parameter and gradient traffic, or "" (activation traffic and pipelines it does not compress)."""
    dp = row.sizes.get("dp", 1) * row.sizes.get("fsdp", 1)
    if row.schedule or dp == 1 or not (row.comm_s > row.compute_s and row.param_comm_s > row.activation_comm_s):
        return ""
    return (
        f"communication-bound ({row.param_comm_s:.3g} s of parameter/gradient traffic > {row.compute_s:.3g} s "
        f"compute): --comm-params int8 --comm-grads int4 move about 1/2 and 1/8 of those bytes"
    )


class SearchResult(list):
    """The ranked rows (fastest first) that fit; `.dropped` holds the rest with the reason."""

    def __init__(self, rows, dropped, meta):
        super().__init__(rows)
        self.dropped, self.meta = dropped, meta

    def to_dict(self) -> dict:
        return {
            "meta": self.meta,
            "ranked": [r.to_dict() for r in self],
            "dropped": [r.to_dict() for r in self.dropped],
        }

    def table(self) -> str:
        m = self.meta
        lines = [
            f"spec search: {m['model']} on {m['world']} x {m['device']}, batch {tuple(m['batch_shape'])}, "
            f"{m['dtype']}, budget {m['budget'] / 2**30:,.1f} GiB/rank; each row's flags are launch.train's",
            f"{'#':>3} {'spec':<22} {'zero':>4} {'step s':>9} {'compute':>9} {'recomp':>8} {'act comm':>9} "
            f"{'par comm':>9} "
            f"{'hidden':>8} {'tok/s':>11} {'MFU':>6} {'mem GiB':>8} {'comm GB':>9}  flags",
        ]
        for i, r in enumerate(self, 1):
            lines.append(_fmt_row(str(i), r))
        if self.dropped:
            lines.append("dropped:")
            for r in self.dropped:
                mem = f"{r.memory['total'] / 2**30:,.1f} GiB" if r.memory else ""
                zero = "" if r.zero is None else f"zero {r.zero}"
                lines.append(f"  {r.spec:<22} {zero:>6} {mem:>12}  {r.note}")
        return "\n".join(lines)


def _fmt_row(rank, r: Row) -> str:
    zero = "-" if r.zero is None else str(r.zero)
    return (
        f"{rank:>3} {r.spec:<22} {zero:>4} {r.step_s:>9.4g} {r.compute_s:>9.4g} {r.recompute_s:>8.3g} "
        f"{r.activation_comm_s:>9.4g} {r.param_comm_s:>9.4g} {r.hidden_s:>8.3g} {r.tokens_per_s:>11,.0f} "
        f"{100 * r.mfu:>5.1f}% {r.memory.get('total', 0) / 2**30:>8.2f} {r.comm_bytes / 1e9:>9.3f}  {r.flags}"
        + (f"  ({r.note})" if r.note else "")
    )


def model_label(cfg) -> str:
    """`LlamaConfig(dim=4096, layers=32, 8.03B params)`; a config without `dim` (`--model hf:DIR`) omits it."""
    n = cfg.num_params() if hasattr(cfg, "num_params") else 0
    shape = [
        f"{label}={getattr(cfg, attr)}"
        for attr, label in (("dim", "dim"), ("n_layers", "layers"))
        if hasattr(cfg, attr)
    ]
    return f"{type(cfg).__name__}({', '.join([*shape, f'{n / 1e9:.2f}B params'])})"
