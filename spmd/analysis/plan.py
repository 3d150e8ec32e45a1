"""The plan `explain` returns: every collective of one training step, the pass's decisions, memory per rank."""

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

from ..runtime.activations.moves import Decision
from .record import Collective

__all__ = ["Plan"]


@dataclass
class Plan:
    mesh: dict
    batch_shape: tuple
    dtype: str
    collectives: list = field(default_factory=list)  # list[Collective]
    decisions: list = field(default_factory=list)  # list[Decision]
    memory: dict = field(default_factory=dict)  # bytes per rank
    pipeline: dict = field(default_factory=dict)  # with pp > 1: stages, bubble, send/recv (explain_pipeline.py)
    attention: dict = field(default_factory=dict)  # bytes per rank: "saved" for backward, "peak" of one call
    notes: list = field(default_factory=list)  # what else the step does differently (linears in float8)

    def totals(self, by=("phase", "kind", "axes")) -> dict:
        """Sum of bytes per rank grouped by record fields, e.g. totals(("kind",))."""
        out = defaultdict(int)
        for c in self.collectives:
            out[tuple(getattr(c, f) for f in by)] += c.bytes
        return dict(out)

    def comm_bytes(self, phase: str | None = None, rank: int | None = None) -> int:
        """Bytes per step (of `phase`, or all) that `rank` moves; without `rank`, the busiest rank's. Ranks
        differ only by collectives with a `per_rank` list (spmd.Muon's exchanges)."""
        rows = [c for c in self.collectives if phase is None or c.phase == phase]
        spread = max((len(c.per_rank) for c in rows), default=0)
        if rank is None and spread:
            return max(self.comm_bytes(phase, r) for r in range(spread))
        return sum(c.bytes_of(rank) for c in rows)

    def comm_bytes_per_rank(self) -> list[int]:
        """Bytes per step of each rank (by global rank) where ranks differ, else []."""
        spread = max((len(c.per_rank) for c in self.collectives), default=0)
        return [self.comm_bytes(rank=r) for r in range(spread)]

    def to_dict(self) -> dict:
        return {
            "mesh": self.mesh,
            "batch_shape": list(self.batch_shape),
            "dtype": self.dtype,
            "collectives": [c.to_dict() for c in self.collectives],
            "decisions": [d.to_dict() for d in self.decisions],
            "memory": self.memory,
            "comm_bytes_per_step": self.comm_bytes(),
            **({"comm_bytes_per_rank": self.comm_bytes_per_rank()} if self.comm_bytes_per_rank() else {}),
            **({"pipeline": self.pipeline} if self.pipeline else {}),
            **({"attention": self.attention} if self.attention else {}),
            **({"notes": self.notes} if self.notes else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(
            mesh=d["mesh"],
            batch_shape=tuple(d["batch_shape"]),
            dtype=d["dtype"],
            collectives=[
                Collective(
                    **{
                        **c,
                        "axes": tuple(c["axes"]),
                        "shape": tuple(c["shape"]),
                        "per_rank": tuple(c.get("per_rank", ())),
                    }
                )
                for c in d["collectives"]
            ],
            decisions=[Decision(**x) for x in d["decisions"]],
            memory=d["memory"],
            pipeline=d.get("pipeline", {}),
            attention=d.get("attention", {}),
            notes=d.get("notes", []),
        )

    def table(self) -> str:
        """One row per (phase, module pattern, why, kind, axes): repeated layers fold into `layers.*`."""
        rows = defaultdict(lambda: [0, 0])
        for c in self.collectives:
            module = _fold(c.module) or "(model)"
            why = _fold(c.reason) or f"{c.origin}: {c.op.split('.')[-2] if '.' in c.op else c.op}"
            key = (c.phase, module, why, c.kind, "+".join(c.axes), c.bytes)
            rows[key][0] += 1
            rows[key][1] += c.bytes
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
        lines = [
            f"plan for mesh {mesh}, batch {tuple(self.batch_shape)}, {self.dtype}; bytes are per rank per step",
            f"{'phase':<9} {'module':<32} {'collective':<14} {'axes':<9} {'count':>5} "
            f"{'bytes each':>14} {'bytes total':>14}  why",
        ]
        order = {"forward": 0, "backward": 1, "optimizer": 2}
        for key in sorted(rows, key=lambda k: (order.get(k[0], 3), k[1], k[3])):
            phase, module, why, kind, axes, each = key
            count, total = rows[key]
            lines.append(f"{phase:<9} {module:<32} {kind:<14} {axes:<9} {count:>5} {each:>14,} {total:>14,}  {why}")
        lines.append("")
        for ph in sorted({c.phase for c in self.collectives}, key=lambda ph: order.get(ph, 3)):
            lines.append(f"total {ph:<9} {self.comm_bytes(ph):>16,} B")
        lines.append(f"total step      {self.comm_bytes():>16,} B")
        spread = self.comm_bytes_per_rank()
        if spread:
            each = ", ".join(f"{b:,}" for b in spread) if len(spread) <= 8 else f"{min(spread):,} to {max(spread):,}"
            lines[-1] += f" (the busiest rank's; per rank: {each})"
        if self.decisions:
            lines.append("")
            lines.append("layout decisions (per rank, bytes of each alternative):")
            lines.extend(sorted({"  " + _fold(d.describe()) for d in self.decisions}))
        if self.pipeline:
            lines.append("")
            lines.extend(_pipeline_lines(self.pipeline))
        if self.memory:
            lines.append("")
            lines.append("memory per rank: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in self.memory.items()))
        if self.attention:
            lines.append(self.attention_line())
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def ring_sends_per_layer(self) -> dict:
        """Bytes per rank the cp ring sends in one attention layer, {"forward": B, "backward": B}."""
        sends = [c for c in self.collectives if c.kind == "send" and "ring" in c.reason]
        layers = max(len({c.module for c in sends}), 1)
        return {ph: sum(c.bytes for c in sends if c.phase == ph) // layers for ph in ("forward", "backward")}

    def attention_line(self) -> str:
        """Attention's memory per rank (part of activations: what it saves; on top: the peak while one call
        runs, the ring's blocks included) and the ring's sends per layer."""
        a, ring = self.attention, self.ring_sends_per_layer()
        line = (
            f"attention per rank: saved for backward {a['saved'] / 2**20:,.2f} MiB (part of activations), "
            f"peak of one call {a['peak'] / 2**20:,.2f} MiB"
        )
        if ring["forward"]:
            line += f"; ring sends per layer: forward {ring['forward']:,} B, backward {ring['backward']:,} B"
        return line

    def __str__(self):
        return self.table()


def _fold(text: str) -> str:
    """layers.3.attention -> layers.*.attention, so repeated blocks share a row."""
    return re.sub(r"\.\d+(?=\.|:|$|\s)", ".*", text)


def _pipeline_lines(section: dict) -> list[str]:
    """Lines for Plan.table()."""
    s = section
    v = f", {s['virtual_stages']} virtual stages per rank" if s["virtual_stages"] > 1 else ""
    lines = [
        f"pipeline: {s['schedule']}, pp={s['pp']}, {s['microbatches']} micro-batches{v}; theoretical bubble "
        f"{100 * s['bubble']:.1f}% of the step",
        f"{'stage':>5} {'rank':>4} {'blocks':<14} {'params':>14} {'FLOPs/step':>18} {'collectives B/micro-batch':>26}",
    ]
    for st in s["stages"]:
        extra = ("+" + ",".join(s["pre"]) if st["first"] and s["pre"] else "") + (
            "+" + ",".join(s["post"]) if st["last"] and s["post"] else ""
        )
        blocks = f"{st['blocks'][0]}-{st['blocks'][1]}"
        lines.append(
            f"{st['index']:>5} {st['rank']:>4} {blocks:<14} {st['params']:>14,} {st['flops']:>18,} "
            f"{st['comm_bytes_per_microbatch']:>26,}  {extra}"
        )
    lines.append(
        f"imbalance (max/mean): FLOPs {s['imbalance_flops']:.3f}, params {s['imbalance_params']:.3f} "
        f"(balanced by {s['split_cost']})"
    )
    lines.append(
        f"send/recv per micro-batch between neighbouring stages: {s['send_recv_bytes_per_microbatch']:,} B "
        f"each way (activation {tuple(s['activation_shape'])} per rank)"
    )
    for r in s["ranks"]:
        lines.append(
            f"  pp rank {r['rank']}: stages {r['stages']}, {r['comm_bytes_per_step']:,} B moved per step, "
            f"{r['memory_total'] / 2**20:,.1f} MiB"
        )
    lines.append(f"the collectives and memory listed are pp rank {s['reported_rank']}'s (the most memory)")
    return lines
