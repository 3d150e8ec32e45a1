"""Pipeline bubble, measured: `python -m benchmarks.pipeline_bubble [--pp 2] [--microbatches 4 8] [--steps 4]`.

Trains a small Llama for a few steps on `pp` CPU processes (gloo) per schedule, and times on each rank the
work inside its stages (forward, and every backward: full, input-gradient or weight-gradient) against the
wall time of the step. The idle fraction 1 - busy/wall is what the schedule leaves unused, to compare with
its theoretical bubble (spmd.pipeline.bubble_fraction: (p-1)/(m+p-1), / v when interleaved, (p-1)/(3m+p-1)/v
for zero-bubble with equal F, B and W times). Measured idle also holds the send/recv and Python overhead
between micro-batches, and the stages are not perfectly balanced (the head makes the last one heavier),
so it sits above the formula. One thread per process; the first step (warm-up, schedule setup) is not timed.
Writes benchmarks/results/<date>-<device>-pipeline-bubble.{json,md}.
"""

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import common

CONFIGS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 2)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, busy):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - t0

    return run


def _worker(rank, world, port, args, out):
    import spmd
    from models.llama import Llama, LlamaConfig
    from spmd.pipeline import bubble_fraction

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = spmd.make_mesh({"pp": world})
    cfg = LlamaConfig.preset(
        "small", n_layers=args.layers, dim=args.dim, ffn_dim=3 * args.dim, max_seq_len=args.seq, kernels="torch"
    )
    rows = []
    for schedule, v in CONFIGS:
        if args.schedules and schedule not in args.schedules:
            continue
        for m in args.microbatches:
            torch.manual_seed(0)
            pipe = spmd.build_pipeline(
                Llama(cfg), mesh, spmd.Rules.default(), schedule=schedule, microbatches=m, virtual_stages=v
            )
            batch = m * args.mb_size
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, cfg.vocab_size, (batch, args.seq + 1), generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:]
            pipe.step(x, y)  # warm-up; builds the schedule
            busy = [0.0]
            for stage in pipe.stages:
                stage.forward_maybe_with_nosync = _timed(stage.forward_maybe_with_nosync, busy)
                stage.backward_maybe_with_nosync = _timed(stage.backward_maybe_with_nosync, busy)
            fractions, walls = [], []
            for _ in range(args.steps):
                dist.barrier()
                busy[0] = 0.0
                t0 = time.perf_counter()
                pipe.step(x, y)
                wall = time.perf_counter() - t0
                walls.append(wall)
                fractions.append(1.0 - busy[0] / wall)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, (statistics.median(fractions), statistics.median(walls)))
            if rank == 0:
                idle = [f for f, _ in per_rank]
                rows.append(
                    {
                        "schedule": schedule,
                        "pp": world,
                        "microbatches": m,
                        "virtual_stages": v,
                        "theoretical_bubble": bubble_fraction(schedule, world, m, v),
                        "measured_idle_mean": statistics.mean(idle),
                        "measured_idle_per_rank": idle,
                        "step_time_s": statistics.median(w for _, w in per_rank),
                        "imbalance": pipe.split.imbalance("flops"),
                    }
                )
                print(
                    f"{schedule:<17} m={m:<3} v={v}  theory {100 * rows[-1]['theoretical_bubble']:5.1f}%  "
                    f"measured {100 * rows[-1]['measured_idle_mean']:5.1f}% (per rank "
                    f"{', '.join(f'{100 * f:.1f}%' for f in idle)})  step {rows[-1]['step_time_s'] * 1e3:.0f} ms",
                    flush=True,
                )
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--schedules", nargs="*", default=None)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.pp, _free_port(), args, queue), nprocs=args.pp, start_method="spawn")
    rows = queue.get()
    env = {**common.environment(), "load_average_1min_before": load_before}
    report = {
        "environment": env,
        "steps_timed": args.steps,
        "model": {"dim": args.dim, "layers": args.layers, "seq": args.seq, "mb_size": args.mb_size},
        "rows": rows,
    }
    lines = [
        f"# Pipeline bubble: measured idle vs theory ({env['device']}, {env['cpu_count']} cores, "
        f"torch {env['torch']}, commit {env['commit'][:12]})",
        "",
        f"Llama dim {args.dim}, {args.layers} layers, seq {args.seq}, {args.mb_size} sequences per micro-batch, "
        f"fp32, pp={args.pp} gloo processes with one thread each; median of {args.steps} steps after a warm-up. "
        "Idle = 1 - (time in stage forward/backward) / (step wall time), per rank, then averaged. "
        f"Load average before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f} "
        "(other work on the machine slows both busy and idle time).",
        "",
        "| schedule | m | v | theoretical bubble | measured idle (mean) | per rank | step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['virtual_stages']} | "
            f"{100 * r['theoretical_bubble']:.1f}% | {100 * r['measured_idle_mean']:.1f}% | "
            f"{' / '.join(f'{100 * f:.1f}%' for f in r['measured_idle_per_rank'])} | "
            f"{1e3 * r['step_time_s']:.0f} |"
        )
    js, md = common.write(
        Path(args.out) / f"{common.today()}-{common.device_slug()}-pipeline-bubble", report, "\n".join(lines)
    )
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
