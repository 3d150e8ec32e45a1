"""Whether gradient reductions overlap backward, by measured time: `python -m benchmarks.overlap
[--model small] [--nproc 2] [--rounds 7] [--bucket-mb 4]`.

The model is laid out as the trainer lays it out (`launch.setup.build_model`) on `dp=nproc` processes (gloo on
CPU, NCCL on GPUs), and forward + backward of one batch (the span the reductions share with compute; the
optimizer step is the same in every variant and left out) is timed in three variants, interleaved round by
round:
  overlapped   the runtime as it is: each full gradient buffer is issued while backward goes on, and waited on
               at the end of backward (spmd.runtime.gradients.reducer)
  serialized   the same buffers and collectives, each waited on as soon as it is issued (what backward would
               cost without overlap)
  no reduction backward under spmd.no_sync: the compute alone
Per round the slowest rank's time counts. exposed = variant - no reduction (the reduction time backward
waits for); overlap = 1 - exposed(overlapped) / exposed(serialized): the share of the reduction time hidden
behind backward, with its range over rounds. Writes benchmarks/results/<date>-<device>-overlap.{json,md}.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common

VARIANTS = ("overlapped", "serialized", "no reduction")


def _serialized(reducer_type):
    class Serialized(reducer_type):
        """Waits for each buffer right after issuing it."""

        def _issue(self, key):
            super()._issue(key)
            self.issued[-1].advance(self.mesh)
            self.issued[-1].pending.results()

    return Serialized


def _worker(a) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    import spmd
    from launch.config import load_config
    from launch.setup import build_model
    from spmd.layout.mesh import exit_process
    from spmd.runtime.gradients.reducer import GradientReducer
    from spmd.runtime.state import STATE_ATTR

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = load_config(
        [
            "--model",
            a.model,
            "--mesh",
            f"dp={world}",
            "--batch-size",
            str(a.batch * world),
            "--seq-len",
            str(a.seq),
            "--dtype",
            a.dtype,
        ]
    )
    model, *_ = build_model(cfg, cfg.model_config(), world, device)
    state = getattr(model, STATE_ATTR)
    reducers = {
        "overlapped": GradientReducer(state.mesh, a.bucket_mb),
        "serialized": _serialized(GradientReducer)(state.mesh, a.bucket_mb),
        "no reduction": None,
    }
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.model_config().vocab_size, (a.batch, a.seq), generator=gen).to(device)

    def once(variant) -> float:
        state.reducer = reducers[variant] or reducers["overlapped"]
        dist.barrier()
        t0 = time.perf_counter()
        with spmd.no_sync(model) if variant == "no reduction" else contextlib.nullcontext():
            model(x, x).backward()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return elapsed

    times = {v: [] for v in VARIANTS}
    for r in range(a.rounds + 1):
        for v in VARIANTS:
            mine = statistics.median(once(v) for _ in range(a.steps))
            slowest = [None] * world
            dist.all_gather_object(slowest, mine)
            if r:  # the first round warms up every variant
                times[v].append(max(slowest))
    if rank == 0:
        print("RESULT " + json.dumps({"times_s": times, "gradient_bytes": grad_bytes}), flush=True)
    exit_process(0)  # gloo's interpreter finalization can abort a finished process


def summarize(times: dict) -> dict:
    """Per round: exposed reduction time of each variant and the share of it the overlap hides."""
    rounds = range(len(times["overlapped"]))
    exposed = {v: [times[v][r] - times["no reduction"][r] for r in rounds] for v in ("overlapped", "serialized")}
    hidden = [1 - o / s for o, s in zip(exposed["overlapped"], exposed["serialized"]) if s > 0]
    ratio = [times["overlapped"][r] / times["serialized"][r] for r in rounds]
    return {
        "median_s": {v: statistics.median(t) for v, t in times.items()},
        "exposed_s": {v: statistics.median(e) for v, e in exposed.items()},
        "overlap": statistics.median(hidden) if hidden else None,
        "overlap_range": [min(hidden), max(hidden)] if hidden else None,
        "overlapped_over_serialized": statistics.median(ratio),
        "ratio_range": [min(ratio), max(ratio)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and round (their median counts)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", help="compute dtype (the trainer's --dtype)")
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=4.0,
        help="gradient buffer size: several buffers fill during backward (default 4; DDP's is 25)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    proc = common.run(
        [
            *common.torchrun(a.nproc),
            "-m",
            "benchmarks.overlap",
            "--worker",
            "--model",
            a.model,
            "--rounds",
            str(a.rounds),
            "--steps",
            str(a.steps),
            "--batch",
            str(a.batch),
            "--seq",
            str(a.seq),
            "--dtype",
            a.dtype,
            "--bucket-mb",
            str(a.bucket_mb),
        ],
        env={"OMP_NUM_THREADS": "1"},
    )
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    s = summarize(result["times_s"])
    env = common.environment()
    report = {
        "environment": env,
        "model": a.model,
        "nproc": a.nproc,
        "rounds": a.rounds,
        "steps": a.steps,
        "batch_per_rank": a.batch,
        "seq": a.seq,
        "bucket_mb": a.bucket_mb,
        **result,
        "summary": s,
    }
    rows = [[v, s["median_s"][v] * 1e3, (s["exposed_s"].get(v, 0.0)) * 1e3] for v in VARIANTS]
    table = common.md_table(["variant", "forward + backward ms (median)", "reduction time exposed ms"], rows)
    lo, hi = s["overlap_range"]
    markdown = (
        f"# Gradient reductions overlapped with backward: {a.model} on dp={a.nproc}\n\n"
        f"{env['device']}, {a.nproc} processes, {a.batch} x {a.seq} tokens per rank, {a.dtype}, "
        f"{result['gradient_bytes'] / 2**20:.1f} MiB of gradients (fp32) in {a.bucket_mb:g} MB buffers; "
        f"{a.rounds} interleaved rounds of {a.steps} steps, slowest rank; commit {env['commit'][:10]}, "
        f"load {env.get('loadavg_1m', 0):.1f}\n\n{table}\n\n"
        f"Overlap (share of the reduction time hidden behind backward): {s['overlap']:.2f} "
        f"[{lo:.2f}, {hi:.2f}] over rounds. Overlapped / serialized forward + backward time: "
        f"{s['overlapped_over_serialized']:.3f} [{s['ratio_range'][0]:.3f}, {s['ratio_range'][1]:.3f}].\n"
    )
    return common.publish("overlap", report, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
