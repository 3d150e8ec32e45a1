"""`spmd.search(model, world_size, device="h100")`: which spec to run, ranked by predicted step time.

    rows = spmd.search(LlamaConfig.preset("8b"), 64, device="h100", batch_shape=(64, 4096))  # or an nn.Module
    print(rows.table())                      # or: python -m spmd.search --model 8b --world 64 --device h100

1. Enumerate the meshes of the world size: every dp x fsdp x cp x tp = world (tp at most one node, 8 devices),
   each tp > 1 with and without sequence parallelism; cp > 1 only for sequences longer than 4096 tokens,
   keeping at least 1024 on each rank. (pp comes later.)
2. Plan each one with `spmd.explain`: its collectives (bytes per rank, per mesh axis) and its memory per
   rank (parameters, gradients, optimizer states, saved activations). A model's blocks are identical, so the
   plan of the full model is the plan of a 1-block copy plus (L-1) times the difference between the 2-block
   and the 1-block copies: exact, and two cheap dry runs per spec instead of one of L blocks.
3. Drop the specs that do not fit the memory budget (default 90% of the device's memory: the rest is for
   the transient gathered parameters, workspaces and the allocator) or do not divide (batch, heads, ...).
4. Rank the rest by predicted step time:
       compute   = FLOPs per rank / (peak FLOP/s x efficiency), FLOPs per token as the model's config counts
                   them (Llama: 6 N_non_embedding + 12 L H Q T), the same for every spec;
       each collective = latency + bytes / bandwidth of its link: within a node (NVLink) when the ranks of
                   its mesh axis sit in one node of 8 (tp is innermost, then fsdp, then dp), else across
                   nodes (InfiniBand);
       overlap   = a fraction `overlap` (0..1) of the parameter traffic (FSDP gathers, gradient
                   reductions) hides behind compute; activation traffic (TP/SP, the cp ring) is on the
                   critical path.
                   The default 0 puts all of it on the critical path, an upper bound: eager spmd issues
                   each block's gather while the block before computes, which hides part of it;
                   1 models a runtime that hides all parameter traffic behind compute;
       step      = compute + activation comm + parameter comm - min(parameter comm, compute) x overlap.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, asdict

import torch.nn as nn

from ..layout.mesh import MESH_AXES, parse_spec
from ..layout.rules import Rules
from .devices import Device, get_device
from .summaries import Summary, as_model, frozen, model_state_bytes, plan_all

__all__ = ["Row", "SearchResult", "candidate_specs", "spec_name", "links", "flops_per_token", "predict", "search",
           "model_state_bytes"]


@dataclass
class Row:
    spec: str
    sizes: dict
    sp: bool
    step_s: float = math.nan
    compute_s: float = math.nan
    activation_comm_s: float = math.nan
    param_comm_s: float = math.nan
    hidden_s: float = 0.0
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

    def to_dict(self) -> dict:
        return {**asdict(self), "comm_s": self.comm_s}


class SearchResult(list):
    """The ranked rows (fastest first) that fit; `.dropped` holds the rest with the reason."""

    def __init__(self, rows, dropped, meta):
        super().__init__(rows)
        self.dropped, self.meta = dropped, meta

    def to_dict(self) -> dict:
        return {"meta": self.meta, "ranked": [r.to_dict() for r in self],
                "dropped": [r.to_dict() for r in self.dropped]}

    def table(self) -> str:
        m = self.meta
        lines = [f"spec search: {m['model']} on {m['world']} x {m['device']}, batch {tuple(m['batch_shape'])}, "
                 f"{m['dtype']}, budget {m['budget'] / 2**30:,.1f} GiB/rank, overlap {m['overlap']:g}",
                 f"{'#':>3} {'spec':<22} {'step s':>9} {'compute':>9} {'act comm':>9} {'par comm':>9} "
                 f"{'hidden':>8} {'tok/s':>11} {'MFU':>6} {'mem GiB':>8} {'comm GB':>9}  links"]
        for i, r in enumerate(self, 1):
            lines.append(_fmt_row(str(i), r))
        if self.dropped:
            lines.append("dropped:")
            for r in self.dropped:
                mem = f"{r.memory['total'] / 2**30:,.1f} GiB" if r.memory else ""
                lines.append(f"  {r.spec:<22} {mem:>12}  {r.note}")
        return "\n".join(lines)


def _fmt_row(rank, r: Row) -> str:
    links = " ".join(f"{a}:{l}" for a, l in r.links.items())
    return (f"{rank:>3} {r.spec:<22} {r.step_s:>9.4g} {r.compute_s:>9.4g} {r.activation_comm_s:>9.4g} "
            f"{r.param_comm_s:>9.4g} {r.hidden_s:>8.3g} {r.tokens_per_s:>11,.0f} {100 * r.mfu:>5.1f}% "
            f"{r.memory.get('total', 0) / 2**30:>8.2f} {r.comm_bytes / 1e9:>9.3f}  {links}")


# ------------------------------------------------------------------------------------------ candidates
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


LONG_SEQ = 4096      # longer sequences also try context parallelism,
MIN_CP_TOKENS = 1024  # keeping at least this many tokens on each cp rank


def _cp_sizes(world: int, seq: int | None) -> list[int]:
    """cp sizes worth trying for sequences of `seq` tokens: 1, and for a long sequence every cp that splits it
    into 2·cp equal chunks of a few hundred tokens or more."""
    if not seq or seq <= LONG_SEQ:
        return [1]
    return [cp for cp in _divisors(world) if cp == 1 or (seq % (2 * cp) == 0 and seq // cp >= MIN_CP_TOKENS)]


def candidate_specs(world: int, max_tp: int = 8, sequence_parallel=(False, True), seq: int | None = None
                    ) -> list[tuple[dict, bool]]:
    """Every (sizes, sp) with dp * fsdp * cp * tp = world and tp <= max_tp; sp only where tp > 1; cp > 1 only
    for a sequence longer than LONG_SEQ."""
    out = []
    for tp in _divisors(world):
        if tp > max_tp:
            continue
        for cp in [c for c in _cp_sizes(world, seq) if (world // tp) % c == 0]:
            for fsdp in _divisors(world // tp // cp):
                dp = world // tp // cp // fsdp
                sizes = {a: s for a, s in (("dp", dp), ("fsdp", fsdp), ("cp", cp), ("tp", tp)) if s > 1} or {"dp": 1}
                for sp in (sequence_parallel if tp > 1 else (False,)):
                    out.append((sizes, sp))
    return out


def spec_name(sizes: dict, sp: bool) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes) + (",sp" if sp else "")


def links(sizes: dict, per_node: int) -> dict:
    """'intra' or 'inter' per mesh axis of size > 1: an axis' ranks are `stride` apart (tp innermost)."""
    out, stride = {}, 1
    world = math.prod(sizes.values())
    for axis in reversed(MESH_AXES):
        size = sizes.get(axis, 1)
        if size > 1:
            out[axis] = "intra" if world <= per_node or stride * size <= per_node else "inter"
        stride *= size
    return dict(reversed(list(out.items())))


# ------------------------------------------------------------------------------------------ the model
def flops_per_token(model: nn.Module, seq: int) -> float:
    """The model config's own count (`cfg.flops_per_token(seq)`) where it has one, else 6 N_non_embedding."""
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "flops_per_token"):
        return cfg.flops_per_token(seq)
    emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return 6 * sum(p.numel() for p in model.parameters() if id(p) not in emb)


def _mesh_problem(model: nn.Module, sizes: dict) -> str | None:
    """Why the model says a mesh cannot lay it out (its config's `mesh_problem`), or None."""
    check = getattr(getattr(model, "cfg", None), "mesh_problem", None)
    return check(sizes) if check is not None else None


# ------------------------------------------------------------------------------------------ the search
def predict(summary: Summary, sizes: dict, dev: Device, compute_s: float, overlap: float) -> dict:
    link = links(sizes, dev.per_node)
    act = par = 0.0
    for (axes, traffic), (count, nbytes) in summary.groups.items():
        inter = any(link.get(a) == "inter" for a in axes.split("+"))
        bw, lat = (dev.inter_bw, dev.inter_latency) if inter else (dev.intra_bw, dev.intra_latency)
        t = count * lat + nbytes / bw
        if traffic == "param":
            par += t
        else:
            act += t
    hidden = overlap * min(par, compute_s)
    return {"activation_comm_s": act, "param_comm_s": par, "hidden_s": hidden,
            "step_s": compute_s + act + par - hidden, "links": link}


def search(model, world_size: int, device="h100", memory_budget_bytes: float | None = None,
           batch_shape=None, dtype: str = "bf16", top: int | None = None, overlap: float = 0.0,
           max_tp: int | None = None, sequence_parallel=(False, True), specs=None,
           workers: int | None = None) -> SearchResult:
    """Ranks the specs of `world_size` ranks for `model` by predicted step time. `model`: an nn.Module (the
    meta device will do), or a model config with `build()` (e.g. a LlamaConfig).

    `device`: "h100" | "h200" | "a100" | "cpu" or a `spmd.analysis.devices.Device`. `memory_budget_bytes`: per rank
    (default 90% of the device's memory). `batch_shape`: global (batch, seq), default (world_size,
    min(max_seq_len, 4096)). `dtype`: compute dtype. `top`: keep the best `top` rows. `overlap`: see the
    module docstring. `specs`: explicit candidates (strings like "fsdp=4,tp=2,sp") instead of all of them.
    `workers`: processes planning the candidates in parallel (spawned: call from under
    `if __name__ == "__main__":`); default 1, in this process. Plans are cached per (model config, spec).
    Returns a list of `Row` (fastest first) with `.dropped` (specs that do not fit or divide, and why),
    `.table()` and `.to_dict()`.
    """
    dev = get_device(device, world_size)
    net = as_model(model)
    cfg = getattr(net, "cfg", None)
    batch, seq = batch_shape or (world_size, min(getattr(cfg, "max_seq_len", 2048), 4096))
    budget = memory_budget_bytes if memory_budget_bytes is not None else 0.9 * dev.memory_per_rank(world_size)
    candidates = _candidates(world_size, specs, max_tp or dev.per_node, sequence_parallel, seq)
    compute_s = flops_per_token(net, seq) * batch * seq / world_size / (dev.peak(dtype) * dev.efficiency)
    unplanned = _screen(net, candidates, world_size, budget)
    jobs = [(frozen(sizes), sp, (batch, seq), str(dtype)) for sizes, sp in candidates if frozen(sizes) not in unplanned]
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        planned = plan_all(net, model, jobs, workers or 1)
    finally:
        quiet.setLevel(level)
    ranked, dropped = [], []
    for sizes, sp in candidates:
        row = Row(spec_name(sizes, sp), dict(sizes), sp, budget=budget)
        if frozen(sizes) in unplanned:
            row.fits, (row.note, row.memory) = False, unplanned[frozen(sizes)]
        else:
            _fill(row, planned[(frozen(sizes), sp, (batch, seq), str(dtype))], dev, compute_s, overlap,
                  batch * seq, flops_per_token(net, seq) / (dev.peak(dtype) * world_size))
        (ranked if row.fits else dropped).append(row)
    ranked.sort(key=lambda r: (r.step_s, r.memory.get("total", 0)))
    meta = {"model": type(net).__name__ if cfg is None else _model_label(cfg),
            "world": world_size, "device": dev.name, "batch_shape": [batch, seq], "dtype": str(dtype),
            "budget": budget, "overlap": overlap, "compute_s": compute_s, "efficiency": dev.efficiency,
            "peak_flops": dev.peak(dtype), "candidates": len(candidates)}
    return SearchResult(ranked[:top] if top else ranked, dropped, meta)


def _candidates(world_size: int, specs, max_tp: int, sequence_parallel, seq=None) -> list[tuple[dict, bool]]:
    if specs is None:
        return candidate_specs(world_size, max_tp, sequence_parallel, seq)
    out = []
    for s in specs:
        sizes, flags = parse_spec(s)
        out.append(({a: v for a, v in sizes.items() if v > 1} or {"dp": 1}, "sp" in flags))
    return out


def _screen(net: nn.Module, candidates, world_size: int, budget: float) -> dict:
    """{frozen sizes: (why, memory)} of the meshes not worth a dry run: wrong size, model states alone over
    the budget, or a mesh the model says it cannot take."""
    out = {}
    for sizes, _ in candidates:
        n = math.prod(sizes.values())
        if n != world_size:
            out[frozen(sizes)] = (f"mesh has {n} ranks, not {world_size}", {})
            continue
        floor = model_state_bytes(net, sizes, Rules.default())
        problem = _mesh_problem(net, sizes)
        if floor > budget:
            out[frozen(sizes)] = (f"parameters, gradients and optimizer states alone need {floor / 2**30:,.1f} "
                                  f"GiB per rank > budget {budget / 2**30:,.1f} GiB (not planned)",
                                  {"states": floor, "total": floor})
        elif problem:
            out[frozen(sizes)] = (problem, {})
    return out


def _fill(row: Row, s, dev: Device, compute_s: float, overlap: float, tokens: int, mfu_per_token_s: float):
    """Fills `row` from its plan summary (or the error planning it raised); `row.fits` says whether it stays.
    `tokens`: per step; `mfu_per_token_s`: FLOPs per token / (peak x world), MFU per token/s."""
    if isinstance(s, Exception):
        row.fits, row.note = False, f"does not lay out: {str(s).splitlines()[0]}"
        return
    row.memory = s.memory
    row.collectives = sum(c for c, _ in s.groups.values())
    row.comm_bytes = sum(b for _, b in s.groups.values())
    for (axes, _), (_, b) in s.groups.items():
        row.bytes_by_axis[axes] = row.bytes_by_axis.get(axes, 0) + b
    p = predict(s, row.sizes, dev, compute_s, overlap)
    row.compute_s, row.activation_comm_s, row.param_comm_s = compute_s, p["activation_comm_s"], p["param_comm_s"]
    row.hidden_s, row.step_s, row.links = p["hidden_s"], p["step_s"], p["links"]
    row.tokens_per_s = tokens / row.step_s
    row.mfu = row.tokens_per_s * mfu_per_token_s
    if s.memory["total"] > row.budget:
        row.fits = False
        row.note = f"needs {s.memory['total'] / 2**30:,.1f} GiB per rank > budget {row.budget / 2**30:,.1f} GiB"


def _model_label(cfg) -> str:
    """`LlamaConfig(dim=4096, layers=32, 8.03B params)`; a config without `dim` (`--model hf:DIR`) omits it."""
    n = cfg.num_params() if hasattr(cfg, "num_params") else 0
    shape = [f"{label}={getattr(cfg, attr)}" for attr, label in (("dim", "dim"), ("n_layers", "layers"))
             if hasattr(cfg, attr)]
    return f"{type(cfg).__name__}({', '.join([*shape, f'{n / 1e9:.2f}B params'])})"
