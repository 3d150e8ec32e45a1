"""`spmd.search(model, world_size, device="h100")`: which spec to run, ranked by predicted step time.

    rows = spmd.search(LlamaConfig.preset("8b"), 8, device="h100", batch_shape=(16, 8192))  # or an nn.Module
    print(rows.table())   # or: python -m spmd.search --model 8b --world 8 --device h100 --batch 16 --seq 8192

1. Enumerate the meshes of the world size: every dp x fsdp x ep x cp x tp = world (tp at most one node, 8
   devices), each tp > 1 with and without sequence parallelism; cp > 1 only for sequences longer than 4096
   tokens, keeping at least 1024 on each rank; ep > 1 only for a mixture of experts, dividing its experts
   (ep splits the data like dp and fsdp; explain plans its all-to-alls at balanced routing). With `max_pp` > 1
   also each of those meshes under a pp axis (pp dividing the world, at most one stage per block), run with
   `pipeline`'s schedule and micro-batches (spmd/analysis/search_pipeline.py: planned whole, bubble included).
   A mesh with an fsdp axis is tried at each ZeRO stage (`Rules.default(zero=k)`): 1 shards the optimizer
   states over fsdp, 2 also the gradients, 3 also the parameters; `zero=` pins one.
2. Plan each one with `spmd.explain`: its collectives (bytes per rank, per mesh axis) and its memory per
   rank (parameters, gradients, optimizer states, saved activations). A model's blocks are identical, so the
   plan of the full model is the plan of a 1-block copy plus (L-1) times the difference between the 2-block
   and the 1-block copies: exact, and two cheap dry runs per spec instead of one of L blocks.
3. Fit the memory budget (default 90% of the device's memory: the rest is for the transient gathered
   parameters, workspaces and the allocator) the way people do, cheapest first: first without activation
   checkpointing, then the least of it that fits (`selective:N`, every N-th block, N falling, then `full`;
   memory includes the one block backward rebuilds at a time), and only then more micro-batches per step
   (`--grad-accum K`, K dividing the sequences per rank, smallest first): a micro-batch holds 1/K of the
   activations but regathers every parameter again and holds the gradients unreduced in their compute
   layout (spmd.no_sync), which under FSDP costs more memory than it saves. Specs that fit no way, or do not
   divide (batch, heads, ...), are dropped with the reason. `ac=` / `grad_accum=` pin the choice.
4. Rank the rest by predicted step time, spmd/analysis/step_time.py: compute, recompute, each collective on
   its link (activation traffic, TP/SP and the cp ring, on the critical path), minus the parameter
   gathers the runtime prefetches behind compute. Stages 1 and 2 move 2Ψ per step against stage 3's 3Ψ,
   but their all-gather of the updated parameters after the step is on the critical path.
Each row names what it assumes as launch.train flags: `--mesh SPEC [--zero K] --ac MODE --grad-accum K`.
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..layout.rules import ZERO_STAGES
from ..runtime.transforms.checkpointing import parse_mode
from .candidates import candidate_specs, candidates, expert_count, mesh_problem, spec_name, zero_stages
from .devices import Device, get_device
from .search_pipeline import Pipeline, pipeline_sizes
from .search_pool import Progress
from .search_rounds import ac_modes, candidate_key, count_blocks, plan_candidates
from .search_rows import Row, SearchResult, compression_note, model_label
from .step_time import flops_per_token, links, predict, recompute_fraction
from .summaries import as_model, frozen, model_state_bytes, rules_for

__all__ = [
    "Row",
    "SearchResult",
    "search_meshes",
    "candidate_specs",
    "spec_name",
    "links",
    "flops_per_token",
    "predict",
    "search",
    "model_state_bytes",
    "ac_modes",
]


def search(
    model,
    world_size: int,
    device="h100",
    memory_budget_bytes: float | None = None,
    batch_shape=None,
    dtype: str = "bf16",
    top: int | None = None,
    max_tp: int | None = None,
    sequence_parallel=(False, True),
    specs=None,
    workers: int | None = None,
    ac: str | None = None,
    grad_accum: int | None = None,
    zero: int | None = None,
    progress: bool = False,
    max_pp: int = 1,
    pipeline: Pipeline | None = None,
) -> SearchResult:
    """Ranks the specs of `world_size` ranks for `model` by predicted step time. `model`: an nn.Module (the
    meta device will do), or a model config with `build()` (e.g. a LlamaConfig).

    `device`: "h100" | "h200" | "a100" | "cpu" or a `spmd.analysis.devices.Device`. `memory_budget_bytes`: per rank
    (default 90% of the device's memory). `batch_shape`: global (batch, seq), default (world_size,
    min(max_seq_len, 4096)). `dtype`: compute dtype. `top`: keep the best `top` rows. `specs`: explicit
    candidates (strings like "fsdp=4,tp=2,sp") instead of all of them. `ac` (none|full|selective:N) and
    `grad_accum` (K): assume these instead of choosing the least that fits (module docstring, step 3).
    `workers`: processes planning the candidates in parallel (spawned: call from under
    `if __name__ == "__main__":`); default 1, in this process. Plans are cached per (model config, spec).
    `progress`: a line on stderr says how far the dry runs are. `max_pp`: also try pipelines of up to this many
    stages; `pipeline`: their schedule and micro-batches (default 1F1B, pp micro-batches); both also apply to
    `specs` that name a pp axis.
    Returns a list of `Row` (fastest first) with `.dropped` (specs that do not fit or divide, and why),
    `.table()` and `.to_dict()`.
    """
    if ac is not None:
        parse_mode(ac)
    if grad_accum is not None and (not isinstance(grad_accum, int) or grad_accum < 1):
        raise ValueError(f"grad_accum must be an integer >= 1 (micro-batches per step), got {grad_accum!r}")
    if zero is not None and zero not in ZERO_STAGES:
        raise ValueError(
            f"zero must be a ZeRO stage {ZERO_STAGES} (1 shards optimizer states over fsdp, 2 also "
            f"gradients, 3 also parameters), got {zero!r}"
        )
    dev = get_device(device, world_size)
    net = as_model(model)
    cfg = getattr(net, "cfg", None)
    batch, seq = batch_shape or (world_size, min(getattr(cfg, "max_seq_len", 2048), 4096))
    budget = memory_budget_bytes if memory_budget_bytes is not None else 0.9 * dev.memory_per_rank(world_size)
    meshes = search_meshes(net, world_size, specs, max_tp or dev.per_node, sequence_parallel, seq, max_pp)
    tried = [(sizes, sp, z) for sizes, sp in meshes for z in zero_stages(sizes, zero)]
    compute_s = flops_per_token(net, seq) * batch * seq / world_size / (dev.peak(dtype) * dev.efficiency)
    unplanned = _screen(net, tried, world_size, budget)
    todo = [c for c in tried if _floor_key(c) not in unplanned]
    shown = Progress(progress)
    chosen = plan_candidates(
        net,
        model,
        todo,
        (batch, seq, str(dtype)),
        budget,
        (ac, grad_accum),
        (workers or 1, shown, pipeline or Pipeline()),
    )
    ranked, dropped = [], []
    for sizes, sp, z in tried:
        row = Row(spec_name(sizes, sp), dict(sizes), sp, zero=z, budget=budget)
        floor = _floor_key((sizes, sp, z))
        if floor in unplanned:
            row.fits, (row.note, row.memory) = False, unplanned[floor]
        else:
            _fill(
                row,
                chosen[candidate_key((sizes, sp, z))],
                dev,
                compute_s,
                count_blocks(net),
                batch * seq,
                flops_per_token(net, seq) / (dev.peak(dtype) * world_size),
            )
        (ranked if row.fits else dropped).append(row)
    ranked.sort(key=lambda r: (r.step_s, r.memory.get("total", 0)))
    meta = {
        "model": type(net).__name__ if cfg is None else model_label(cfg),
        "world": world_size,
        "device": dev.name,
        "batch_shape": [batch, seq],
        "dtype": str(dtype),
        "budget": budget,
        "compute_s": compute_s,
        "efficiency": dev.efficiency,
        "peak_flops": dev.peak(dtype),
        "candidates": len(tried),
        "ac": ac,
        "grad_accum": grad_accum,
        "zero": zero,
        "dry_runs": shown.dry_runs,
    }
    return SearchResult(ranked[:top] if top else ranked, dropped, meta)


def search_meshes(
    net, world: int, specs, max_tp: int, sequence_parallel=(False, True), seq=None, max_pp: int = 1
) -> list[tuple[dict, bool]]:
    """The (sizes, sp) a search tries: `specs`, or every candidate mesh and, for each pp of
    `pipeline_sizes(world, blocks, max_pp)`, every mesh of world / pp ranks under that pp axis."""
    meshes = candidates(world, specs, max_tp, sequence_parallel, seq, expert_count(net))
    if specs is None:
        meshes += [
            ({"pp": pp, **{a: n for a, n in sizes.items() if n > 1}}, sp)
            for pp in pipeline_sizes(world, count_blocks(net), max_pp)
            for sizes, sp in candidates(world // pp, None, max_tp, sequence_parallel, seq, expert_count(net))
        ]
    return meshes


def _floor_key(candidate) -> tuple:
    """What a candidate's model-state floor depends on: its mesh and ZeRO stage."""
    sizes, _, zero = candidate
    return frozen(sizes), zero


def _screen(net: nn.Module, candidates, world_size: int, budget: float) -> dict:
    """{(frozen sizes, zero): (why, memory)} of the meshes and stages not worth a dry run: wrong size, model
    states alone over the budget, or a mesh the model says it cannot take."""
    out = {}
    for sizes, sp, zero in candidates:
        key = _floor_key((sizes, sp, zero))
        n = math.prod(sizes.values())
        if n != world_size:
            out[key] = (f"mesh has {n} ranks, not {world_size}", {})
            continue
        # a pipeline's stages split the states: the rank holding most holds at least their mean
        floor = model_state_bytes(net, sizes, rules_for(False, zero)) // sizes.get("pp", 1)
        problem = mesh_problem(net, sizes)
        if floor > budget:
            out[key] = (
                f"parameters, gradients and optimizer states alone need {floor / 2**30:,.1f} "
                f"GiB per rank > budget {budget / 2**30:,.1f} GiB (not planned)",
                {"states": floor, "total": floor},
            )
        elif problem:
            out[key] = (problem, {})
    return out


def _fill(row: Row, chosen, dev: Device, compute_s: float, n_blocks: int, tokens: int, mfu_per_token_s: float):
    """Fills `row` from its chosen plan (or the error planning it raised); `row.fits` says whether it stays.
    `tokens`: per step; `mfu_per_token_s`: FLOPs per token / (peak x world), MFU per token/s."""
    s, row.ac, row.grad_accum, *section = chosen
    if isinstance(s, Exception):
        row.fits, row.note = False, f"does not lay out: {str(s).splitlines()[0]}"
        return
    row.memory = s.memory
    row.collectives = sum(c for c, _, _ in s.groups.values())
    row.comm_bytes = sum(b for _, b, _ in s.groups.values())
    for (axes, _, _), (_, b, _) in s.groups.items():
        row.bytes_by_axis[axes] = row.bytes_by_axis.get(axes, 0) + b
    row.recompute_s = compute_s / 3 * recompute_fraction(row.ac, n_blocks)
    p = predict(s, row.sizes, dev, compute_s, row.recompute_s)
    row.compute_s, row.activation_comm_s, row.param_comm_s = compute_s, p["activation_comm_s"], p["param_comm_s"]
    row.hidden_s, row.step_s, row.links = p["hidden_s"], p["step_s"], p["links"]
    if section and section[0]:  # a pipeline idles `bubble` of its step
        pipe = section[0]
        row.schedule, row.microbatches = pipe["schedule"], pipe["microbatches"]
        row.bubble_s = row.step_s * pipe["bubble"] / (1 - pipe["bubble"])
        row.step_s += row.bubble_s
    row.tokens_per_s = tokens / row.step_s
    row.mfu, row.note = row.tokens_per_s * mfu_per_token_s, compression_note(row)
    if s.memory["total"] > row.budget:
        row.fits = False
        row.note = (
            f"needs {s.memory['total'] / 2**30:,.1f} GiB per rank > budget {row.budget / 2**30:,.1f} GiB "
            f"even with --ac {row.ac} --grad-accum {row.grad_accum}"
        )
