"""The search's planning rounds (step 3 of spmd.analysis.search): per candidate, the first (K, ac) whose plan
fits the budget, every candidate's next try planned in one round of dry runs (search_pool.plan_all); the
pipeline candidates planned whole (search_pipeline)."""

from __future__ import annotations

import logging
import math

import torch.nn as nn

from ..layout.blocks import find_blocks
from ..layout.rules import Rules
from .derived import full_from_none, same_plan
from .fake import kept_worlds
from .search_pipeline import Pipeline, plan_pipeline
from .search_pool import Workers, lightest, plan_all, verdict
from .summaries import ONE_BLOCK, accumulated, checkpointed, frozen

__all__ = ["ac_modes", "count_blocks", "candidate_key", "plan_candidates"]


def ac_modes(n_blocks: int) -> list[str]:
    """Checkpointing from least to most recompute: none, selective:N for 1, 2, ... checkpointed blocks (the
    smallest N for each count), full."""
    modes = ["none"]
    for k in range(1, n_blocks + 1):
        n = math.ceil(n_blocks / k)
        mode = "full" if n == 1 else f"selective:{n}"
        if mode not in modes:
            modes.append(mode)
    return modes


def count_blocks(net: nn.Module) -> int:
    try:
        return len(find_blocks(net)[1])
    except ValueError:
        return 0


def candidate_key(candidate) -> tuple:
    """A candidate (sizes, sp, zero stage) as a dict key."""
    sizes, sp, zero = candidate
    return frozen(sizes), sp, zero


def _fit(net, todo, shape, budget, pinned, workers) -> dict:
    """{candidate key: (Summary or error, ac, K)}: per spec the first (K, ac) of step 3 that fits the
    budget, else the last tried. Planned in rounds, every spec's next try in one `plan_all`."""
    batch = shape[0]
    ac, grad_accum = pinned
    modes = [ac] if ac is not None else ac_modes(count_blocks(net))
    out, pending = {}, {}
    for sizes, sp, z in todo:
        local = batch // Rules.default(sp).data_parallel_size(sizes)
        pending[candidate_key((sizes, sp, z))] = (
            [grad_accum] if grad_accum else [k for k in range(1, local + 1) if local % k == 0] or [1]
        )
    while pending:
        nones = _plan_round(net, pending, "none", shape, workers)
        needs = {
            key: pending[key]
            for key, none in nones.items()
            if modes != ["none"] and not isinstance(none, Exception) and not _fits(none, modes, budget)
        }
        nones.update(_plan_round(net, needs, "none", shape, workers, block=True))
        fulls = _plan_full(net, needs, nones, shape, workers)
        for key in list(pending):
            k, none, full = pending[key][0], nones[key], fulls.get(key)
            error = next((s for s in (none, full) if isinstance(s, Exception)), None)
            out[key] = (error, modes[0], k) if error is not None else _least_that_fits(none, full, modes, k, budget)
            pending[key] = pending[key][1:]
            if error is not None or out[key][0].memory["total"] <= budget or not pending[key]:
                del pending[key]
    return out


def _plan_full(net, needs: dict, nones: dict, shape, workers) -> dict:
    """{spec key: plan under full checkpointing} of `needs`: derived from its plan without checkpointing and a
    1-block dry run (derived.full_from_none) where, on the first spec, the derived plan equals the one of the
    1- and 2-block copies under full. It does not for a model whose blocks share a tensor made outside them
    (a Hugging Face decoder's rotary cos/sin): the blocks save it once without checkpointing, each checkpointed
    block once more. Such a model is planned from both copies. Checked once per model (search_pool.verdict),
    the verdict holds for its later rounds and searches."""
    held = verdict(net, "full_from_none")
    if held is False:
        return _plan_round(net, needs, "full", shape, workers, block=True)
    probe = lightest(needs) if needs and held is None else None
    check = {probe: needs[probe]} if probe is not None else {}  # its exact plan in the same round, not after
    ones, exacts = _plan_rounds(net, [(needs, ONE_BLOCK), (check, True)], "full", shape, workers)
    fulls = {key: full_from_none(nones[key], one) for key, one in ones.items()}
    laid_out = [key for key, full in fulls.items() if not isinstance(full, Exception)]
    if not laid_out or held:
        return fulls
    if probe not in laid_out:  # the lightest of them did not lay out: check on the lightest that did
        probe = lightest(laid_out)
        exacts = _plan_round(net, {probe: needs[probe]}, "full", shape, workers, block=True)
    if verdict(net, "full_from_none", same_plan(fulls[probe], exacts[probe])):
        return {**fulls, probe: exacts[probe]}
    return _plan_round(net, needs, "full", shape, workers, block=True)


def plan_candidates(net, model, todo, shape, budget, pinned, how) -> dict:
    """{candidate key: chosen plan} of every candidate in `todo`: the pp ones planned whole, the rest by _fit in
    `how`'s (processes, Progress, Pipeline)."""
    processes, shown, pipeline = how
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        meshes = {frozen(c[0]) for c in todo if "pp" not in c[0]}  # workers take whole meshes: none for one
        with kept_worlds(), Workers(model, processes if len(meshes) > 1 else 1) as pool:
            chosen = _fit(net, [c for c in todo if "pp" not in c[0]], shape, budget, pinned, (pool, shown))
        chosen.update(_fit_pipelines(net, [c for c in todo if "pp" in c[0]], shape, budget, pinned[0], pipeline))
    finally:
        quiet.setLevel(level)
        shown.close()
    return chosen


def _fit_pipelines(net, todo, shape, budget, ac, how: Pipeline) -> dict:
    """{candidate key: (Summary or error, ac, 1, pipeline section)} of the pp candidates, planned whole."""
    modes = [ac] if ac is not None else ["none", "full"]
    return {candidate_key(c): plan_pipeline(net, candidate_key(c), shape, budget, modes, how) for c in todo}


def _plan_round(net, pending: dict, mode: str, shape, workers, block=False) -> dict:
    """{spec key: plan or error} of each pending spec at its next K with checkpointing `mode`, in one plan_all;
    `block`: with one block's share (checkpointing composes from it), or ONE_BLOCK: the 1-block copy's plan
    alone (derived.full_from_none). `workers`: (Workers, Progress)."""
    return _plan_rounds(net, [(pending, block)], mode, shape, workers)[0]


def _plan_rounds(net, asked: list, mode: str, shape, workers) -> list[dict]:
    """_plan_round of each (pending, block) in `asked`, all in one plan_all: their dry runs share the workers."""
    batch, seq, dtype = shape
    jobs = [{key: _job(key, ks[0], mode, batch, seq, dtype) + (block,) for key, ks in p.items()} for p, block in asked]
    pool, progress = workers
    progress.stage = f"--ac {mode}"
    every = sorted({job for j in jobs for job in j.values()}, key=repr)
    planned = plan_all(net, every, pool, progress) if every else {}
    return [{key: planned[job] for key, job in j.items()} for j in jobs]


def _fits(none, modes, budget: float) -> bool:
    """Whether the plan without checkpointing is the answer: allowed, and within the budget (a plan of two
    micro-batches has the memory of K, see summaries.accumulated)."""
    return modes[0] == "none" and none.memory["total"] <= budget


def _passes(k: int) -> int:
    """Micro-batches a dry run plans for K of them: one, or two (the first under no_sync) that summaries.accumulated
    turns into K."""
    return 1 if k == 1 else 2


def _job(key, k: int, mode: str, batch: int, seq: int, dtype: str) -> tuple:
    """The plan_all job of a spec at K micro-batches: K = 1 as it is, else two of them (no_sync, then sync)."""
    sizes, sp, zero = key
    return (sizes, sp, zero, (batch * _passes(k) // k, seq), dtype, mode, _passes(k))


def _least_that_fits(none, full, modes, k: int, budget: float):
    """(plan of K micro-batches, ac, K) for the first of `modes` that fits, else for the last."""
    for mode in modes:
        s = accumulated(none if mode == "none" else checkpointed(none, full, mode), _passes(k), k)
        if s.memory["total"] <= budget:
            break
    return s, mode, k
