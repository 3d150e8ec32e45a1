"""Where the search's dry runs run: in this process or in spawned worker processes, grouped by mesh so that a
mesh's fake world and DTensor's cached plans serve all of its dry runs, in every round (fake.kept_worlds: the
search's process and each worker keep their world from the first round to the last), with a progress
line on stderr, and workers that end with the search: stopped (SIGINT, SIGTERM) or killed, it takes them along."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time

import torch.nn as nn

from ..layout.annotate import fake_copy
from .derived import same_plan, zero2_from
from .fake import kept_worlds
from .summaries import DRY_RUNS, Summary, _blocks, _cache, _cache_key, as_model, planned, rules_for

__all__ = ["plan_all", "Progress", "Workers", "stop_on_term", "verdict", "lightest"]

_worker_model = None
_worker_scope = contextlib.ExitStack()  # open for the worker's life: the pool terminates it


class Progress:
    """`spmd.search: --ac none: 12/40 meshes planned, 35 s, planning cp=2,fsdp=2,tp=2` on stderr, one line
    rewritten in place; silent unless `on`. `stage`: what the current round plans; `planning`: the mesh a dry
    run in this process is on (a mesh of three axes can take minutes)."""

    def __init__(self, on: bool, stream=None):
        self.on, self.stream, self.start, self.stage = on, stream or sys.stderr, time.perf_counter(), ""
        self.dry_runs = 0  # explain dry runs made for the search, in this process and its workers

    def show(self, done: int, total: int, planning: str = "") -> None:
        if self.on:
            print(
                f"\rspmd.search: {self.stage}{': ' if self.stage else ''}{done}/{total} meshes planned, "
                f"{time.perf_counter() - self.start:.0f} s{', planning ' if planning else ''}{planning}\033[K",
                end="",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.on:
            print(file=self.stream, flush=True)


def stop_on_term() -> None:
    """SIGTERM raises SystemExit in the main thread, as SIGINT raises KeyboardInterrupt: a search in progress
    unwinds, its worker pool is terminated on the way out."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _first_line(e: Exception) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _die_with_parent() -> None:
    """Linux: this worker gets SIGTERM when its parent dies, however the parent ends (even SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_init(model_or_cfg):
    global _worker_model
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops on ^C and terminates the pool
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _worker_model = as_model(model_or_cfg)
    _worker_scope.enter_context(kept_worlds())  # a worker's meshes keep their plans from round to round


def _plan_one(model, job):
    sizes, sp, zero, batch_shape, dtype, *how = job
    try:
        return planned(model, sizes, sp, batch_shape, dtype, rules_for(sp, zero), *how)
    except (ValueError, RuntimeError) as e:  # a layout that does not divide (DTensor says RuntimeError)
        return ValueError(_first_line(e))


def _plan_group(jobs):
    """The dry runs of one mesh, one after another in one fake world: ([(job, plan)], dry runs made)."""
    before = DRY_RUNS[0]
    with kept_worlds():
        return [(job, _plan_one(_worker_model, job)) for job in jobs], DRY_RUNS[0] - before


def _job_key(net, job):
    """planned()'s cache key of a plan_all job."""
    sizes, sp, zero, batch_shape, dtype, ac, grad_accum, block = job
    block = block or len(_blocks(net)[1]) > 2
    return _cache_key(net, sizes, sp, batch_shape, dtype, rules_for(sp, zero), (ac, grad_accum, block))


def _by_mesh(jobs: list) -> list[list]:
    groups: dict = {}
    for job in jobs:
        groups.setdefault(job[0], []).append(job)
    return list(groups.values())


class Workers:
    """The search's worker processes (none for `processes` 1), spawned on entering the `with` block, so that they
    start (import torch, copy the model) while this process checks the derivations on its first mesh, and kept
    for every round; terminated when the block ends, however it ends. A mesh is planned where it was planned
    before: its first dry run prices every op's strategies on that mesh (most of a search's time), and the
    worker keeps those prices for its later rounds."""

    def __init__(self, model_arg, processes: int):
        self.model_arg, self.processes, self.pools, self.pids = model_arg, processes, [], set()
        self.owner: dict = {}  # mesh -> the worker that planned it

    def __enter__(self):
        if self.processes > 1:
            import multiprocessing

            arg = self.model_arg
            payload = arg if not isinstance(arg, nn.Module) else fake_copy(arg, None)
            spawn = multiprocessing.get_context("spawn")
            self.pools = [spawn.Pool(1, _worker_init, (payload,)) for _ in range(self.processes)]
            self.pids = {p.pid for p in self._processes()}
        return self

    def __exit__(self, *exc):
        for pool in self.pools:
            pool.terminate()
        for pool in self.pools:
            pool.join()

    def map(self, groups: list):
        """The results of `_plan_group` on each group, in the order they finish. A free worker takes its own
        meshes first, then new ones (most axes first: the costliest), then another worker's. A worker that dies
        (at start, or killed) would leave its group unanswered and its pool respawning it: that raises instead."""
        queues = {w: [] for w in range(len(self.pools))}
        fresh = sorted((g for g in groups if g[0][0] not in self.owner), key=lambda g: -_axes(g[0][0]))
        for group in groups:
            if group[0][0] in self.owner:
                queues[self.owner[group[0][0]]].append(group)
        running, left = {}, len(groups)
        while left:
            for w in queues:
                group = None if w in running else _next_group(w, queues, fresh)
                if group is not None:
                    self.owner[group[0][0]] = w
                    running[w] = self.pools[w].apply_async(_plan_group, (group,))
            finished = [w for w, result in running.items() if result.ready()]
            for w in finished:
                left -= 1
                yield running.pop(w).get()
            if not finished:
                next(iter(running.values())).wait(0.05)
                self._check_alive()

    def _processes(self) -> list:
        return [p for pool in self.pools for p in pool._pool]  # a pool's worker processes (no public view)

    def _check_alive(self) -> None:
        """Raises once a worker has ended: a pool replaces it silently and its group is never answered."""
        if any(p.exitcode is not None or p.pid not in self.pids for p in self._processes()):
            raise RuntimeError(
                "a worker process of the search ended unexpectedly (its error, if any, is above); "
                "run with workers=1 (--workers 1) to plan in this process and see it"
            )


def _axes(mesh) -> int:
    """How many axes of a mesh (its sizes as pairs) have more than one rank."""
    return sum(n > 1 for _, n in mesh)


def _next_group(w: int, queues: dict, fresh: list):
    """Worker w's next group: its own, else a new mesh, else the last of the longest queue of another worker."""
    if queues[w]:
        return queues[w].pop(0)
    if fresh:
        return fresh.pop(0)
    other = max(queues, key=lambda v: len(queues[v]))
    return queues[other].pop() if queues[other] else None


def plan_all(net: nn.Module, jobs: list, workers: Workers | None = None, progress: Progress | None = None) -> dict:
    """{job: Summary or ValueError}, planned in this process or by `workers`. A job is (sizes, sp, zero,
    batch_shape, dtype, ac, grad_accum, block): `planned`'s arguments, with the rules as `rules_for(sp, zero)`.
    A ZeRO 2 job whose ZeRO 1 and 3 siblings are planned too (or cached) is derived from them (derived.zero2_from)
    once the derivation held for this model on a first job; where it did not, or either stage fails to lay out,
    it is dry-run."""
    progress = progress or Progress(False)
    asked = set(jobs)
    siblings = {  # derived where ZeRO 1 and 3 are planned anyway: a sibling planned for it alone saves nothing
        j: sibs
        for j, sibs in ((j, (_at_zero(j, 1), _at_zero(j, 3))) for j in jobs if j[2] == 2)
        if all(s in asked or _job_key(net, s) in _cache for s in sibs)
    }
    trusted = _zero2_trusted(net, siblings, workers, progress) if siblings else False
    dry = sorted({s for j in jobs for s in (siblings[j] if trusted and j in siblings else (j,))}, key=repr)
    results = _dry_run_all(net, dry, workers, progress)
    for job in jobs:
        if job not in results:
            results[job] = zero2_from(*(results[s] for s in siblings[job]))
            if isinstance(results[job], Exception):  # a stage that fails need not fail at ZeRO 2
                results[job] = _plan_one(net, job)
    return {job: results[job] for job in jobs}


def _at_zero(job: tuple, zero: int) -> tuple:
    return (*job[:2], zero, *job[3:])


def _zero2_trusted(net: nn.Module, siblings: dict, workers, progress) -> bool:
    """Whether derived.zero2_from holds for `net`: checked once per model (kept in summaries' cache) on the first
    ZeRO 2 job against its dry run."""
    if verdict(net, "zero2_from") is None:
        job = lightest(siblings)
        done = _dry_run_all(net, [job, *siblings[job]], workers, progress)
        if isinstance(done[job], Exception):
            return False  # nothing to check it on: plan this round's ZeRO 2 jobs, check on a later one
        verdict(net, "zero2_from", same_plan(zero2_from(*(done[s] for s in siblings[job])), done[job]))
    return verdict(net, "zero2_from")


def lightest(jobs):
    """The job or spec key (mesh sizes first) to check a derivation on: the mesh of fewest axes, then without cp
    (DTensor prices each op's strategies over every axis: a first dry run on `cp=2,dp=2,tp=2` costs ten times
    one on `fsdp=8`); a derivation holds for a model or not, whichever mesh checks it."""
    return min(jobs, key=lambda job: (_axes(job[0]), dict(job[0]).get("cp", 1) > 1, repr(job)))


def verdict(net: nn.Module, rule: str, held: bool | None = None) -> bool | None:
    """Whether a derivation `rule` held for `net` (None: not checked yet); with `held`, remembers it. Kept in
    summaries' plan cache (its `clear()` forgets it, and a model named by no config is kept alive with it):
    checked on one job, a rule is trusted for the model's other jobs."""
    key = (f"{rule} holds", _cache_key(net, {}, False, (), "", None)[0])
    if held is not None:
        _cache[key] = (net if getattr(net, "cfg", None) is None else None, held)
    return _cache.get(key, (None, None))[1]


def _dry_run_all(net: nn.Module, jobs: list, workers: Workers | None, progress: Progress) -> dict:
    """{job: Summary or ValueError} of `jobs`, each dry-run (or taken from the cache)."""
    groups = _by_mesh([j for j in jobs if _job_key(net, j) not in _cache])
    results, before = {}, DRY_RUNS[0]
    if workers is not None and workers.pools and len(groups) > 1:
        progress.show(0, len(groups))
        for i, (done, dry_runs) in enumerate(workers.map(groups), 1):
            progress.dry_runs += dry_runs
            for job, out in done:
                results[job] = out
                if isinstance(out, Summary):
                    _cache[_job_key(net, job)] = (net if getattr(net, "cfg", None) is None else None, out)
            progress.show(i, len(groups))
    else:
        with kept_worlds():
            for i, group in enumerate(groups, 1):
                progress.show(i - 1, len(groups), ",".join(f"{a}={n}" for a, n in group[0][0]))
                results.update((job, _plan_one(net, job)) for job in group)
                progress.show(i, len(groups))
    for job in jobs:
        if job not in results:
            results[job] = _plan_one(net, job)
    progress.dry_runs += DRY_RUNS[0] - before
    return results
