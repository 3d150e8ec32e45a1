"""Step times and in-step collective times of many specs in one torchrun launch (for search_vs_measured).

    torchrun --standalone --nproc-per-node 4 -m benchmarks.spec_steps OUT.json --job tiny:dp=4 small:tp=4,sp ...
        [--batch 8] [--seq 128] [--steps 8] [--warmup 3]

Each job (model:spec) in turn, in the order given, in the same processes: the model, optimizer and data as
launch.train sets them up (`launch.train._set_up` of the job's config: fp32, ZeRO 3, no checkpointing), `warmup`
steps, then `steps` timed steps (forward, backward and optimizer step, `launch.step`'s own functions, on rank
0's clock), then one more step under spmd.analysis.timed.TimedRecorder: each collective's issue-to-completion
seconds, the median over ranks (every rank issues the same collectives in the same order). That step waits for
each collective where it is issued, so its own time is not one of the timed steps. Rank 0 writes
{"jobs": [{"model", "spec", "step_times", "collectives": spmd.analysis.timed.samples rows}]}.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist


def _config(model: str, spec: str, a, steps: int):
    from launch.config import load_config

    sizes = ",".join(p for p in spec.split(",") if p != "sp")
    argv = ["--model", model, "--mesh", sizes, "--steps", str(steps), "--batch-size", str(a.batch)]
    argv += ["--seq-len", str(a.seq), "--dtype", "fp32", "--zero", "3", "--ac", "none"]
    return load_config(argv + (["--sp"] if spec.endswith(",sp") else []))


def _step(run, step: int, recorder=None) -> float:
    from launch.step import forward_backward, optimizer_step

    micro = run.loader.next()
    t0 = time.perf_counter()
    with recorder if recorder is not None else contextlib.nullcontext():
        optimizer_step(run, step, forward_backward(run, micro))
    return time.perf_counter() - t0


def measure(model: str, spec: str, a) -> dict:
    """One job: its timed steps and its timed collectives (module docstring)."""
    from launch.train import _set_up
    from spmd.analysis.timed import TimedRecorder, samples

    run = _set_up(_config(model, spec, a, a.warmup + a.steps + 1), log=False)
    try:
        times = [_step(run, i) for i in range(a.warmup + a.steps)][a.warmup :]
        recorder = TimedRecorder(run.mesh)
        _step(run, a.warmup + a.steps, recorder)
    finally:
        run.close()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, recorder.seconds)
    seconds = [statistics.median(s) for s in zip(*every)]
    sizes = run.cfg.mesh_sizes(run.world)
    del run
    gc.collect()
    return {"model": model, "spec": spec, "step_times": times, "collectives": samples(recorder, sizes, seconds)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--job", nargs="+", required=True, help="model:spec, measured in this order")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    jobs = []
    try:
        for job in a.job:
            model, _, spec = job.partition(":")
            jobs.append(measure(model, spec, a))
        if dist.get_rank() == 0:
            Path(a.out).write_text(json.dumps({"jobs": jobs}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmd.layout.mesh import exit_process

    exit_process(main())  # not sys.exit: see exit_process
