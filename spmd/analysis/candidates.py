"""The search's candidates: every mesh of a world size (dp x fsdp x ep x cp x tp, tp within a node, sp
twins, cp for long sequences, ep for experts), or the specs a user names, and the ZeRO stages worth trying
on each."""

from __future__ import annotations

import torch.nn as nn

from ..layout.annotate import get_axes
from ..layout.mesh import MESH_AXES, parse_spec
from ..runtime.experts.dispatch import EXPERTS, expert_modules

__all__ = [
    "candidate_specs",
    "candidates",
    "zero_stages",
    "spec_name",
    "expert_count",
    "mesh_problem",
    "LONG_SEQ",
    "MIN_CP_TOKENS",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


LONG_SEQ = 4096  # longer sequences also try context parallelism,
MIN_CP_TOKENS = 1024  # keeping at least this many tokens on each cp rank


def _cp_sizes(world: int, seq: int | None) -> list[int]:
    """cp sizes worth trying for sequences of `seq` tokens: 1, and for a long sequence every cp that splits it
    into 2·cp equal chunks of a few hundred tokens or more."""
    if not seq or seq <= LONG_SEQ:
        return [1]
    return [cp for cp in _divisors(world) if cp == 1 or (seq % (2 * cp) == 0 and seq // cp >= MIN_CP_TOKENS)]


def candidate_specs(
    world: int, max_tp: int = 8, sequence_parallel=(False, True), seq: int | None = None, experts: int = 0
) -> list[tuple[dict, bool]]:
    """Every (sizes, sp) with dp * fsdp * ep * cp * tp = world and tp <= max_tp; sp only where tp > 1; cp > 1
    only for a sequence longer than LONG_SEQ; ep > 1 only for a model of `experts` experts, dividing them."""
    out = []
    for tp in _divisors(world):
        if tp > max_tp:
            continue
        for cp in [c for c in _cp_sizes(world, seq) if (world // tp) % c == 0]:
            for ep in [e for e in _divisors(world // tp // cp) if e == 1 or (experts and experts % e == 0)]:
                for fsdp in _divisors(world // tp // cp // ep):
                    dp = world // tp // cp // ep // fsdp
                    sizes = {
                        a: s for a, s in (("dp", dp), ("fsdp", fsdp), ("ep", ep), ("cp", cp), ("tp", tp)) if s > 1
                    } or {"dp": 1}
                    for sp in sequence_parallel if tp > 1 else (False,):
                        out.append((sizes, sp))
    return out


def zero_stages(sizes: dict, zero: int | None = None) -> list[int | None]:
    """The ZeRO stages worth planning on a mesh: None (nothing to choose) without an fsdp axis, else `zero`
    where pinned, else 1, 2 and 3."""
    if sizes.get("fsdp", 1) == 1:
        return [None]
    return [zero] if zero is not None else [1, 2, 3]


def expert_count(model: nn.Module) -> int:
    """How many experts ep may split: those the model's expert modules stack (0: not a mixture of experts)."""
    return max(
        (
            p.shape[0]
            for m in expert_modules(model).values()
            for p in m.parameters(recurse=False)
            if EXPERTS in (get_axes(p) or ())
        ),
        default=0,
    )


def spec_name(sizes: dict, sp: bool) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes) + (",sp" if sp else "")


def mesh_problem(model: nn.Module, sizes: dict) -> str | None:
    """Why the model says a mesh cannot lay it out (its config's `mesh_problem`), or None."""
    check = getattr(getattr(model, "cfg", None), "mesh_problem", None)
    return check(sizes) if check is not None else None


def candidates(world_size: int, specs, max_tp: int, sequence_parallel, seq=None, experts=0) -> list[tuple[dict, bool]]:
    """`specs` (strings like "fsdp=4,tp=2,sp") as (sizes, sp), or, when None, every candidate_specs."""
    if specs is None:
        return candidate_specs(world_size, max_tp, sequence_parallel, seq, experts)
    out = []
    for s in specs:
        sizes, flags = parse_spec(s)
        out.append(({a: v for a, v in sizes.items() if v > 1} or {"dp": 1}, "sp" in flags))
    return out
