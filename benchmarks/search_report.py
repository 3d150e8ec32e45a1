"""The spec search as a results file: `python -m benchmarks.search_report --model 8b --world 64 --device h100`.

Writes results/<date>-search-<model>-<world>x<device>-<batch>x<seq>.{json,md}: `spmd.search`'s ranking (a
prediction, not a measurement; spmd/analysis/search.py says how each term is modelled) with the commit and how
long the search took (wall clock, and the CPU seconds of this process and its workers: the machine may be
shared).

`--published` instead plans the runs torchtitan published (benchmarks/llama3_h100_202412_torchtitan.md, H100
96 GB at 500 W) and writes results/<date>-search-vs-published.{json,md} with the error of each prediction
(predicted / published - 1: positive means the planner is optimistic).

`--against REV [--specs ...] [--rounds N]` instead times the search at commit REV and in this tree, rounds
interleaved, and writes results/<date>-search-speed-<model>-<world>x<device>.{json,md} (benchmarks/search_speed.py).
"""

import argparse
import os
import resource
import time
from pathlib import Path

import models
import spmd
from benchmarks import common, search_speed
from spmd.analysis.devices import DEVICES

# (label, model, world, spec, global batch shape, ac, published tokens/s per GPU, published GiB, how they ran)
PUBLISHED = [
    (
        "8B on 8 H100, FSDP",
        "8b",
        8,
        "fsdp=8",
        (16, 8192),
        "selective:2",
        5762,
        82.4,
        "local batch 2 x 8192, selective (op) AC, bf16, eager (Table 1)",
    ),
    (
        "70B on 256 H100, FSDP 32 x TP 8",
        "70b",
        256,
        "fsdp=32,tp=8,sp",
        (512, 8192),
        "full",
        829,
        71.9,
        "local batch 16 x 8192, full AC, torch.compile + Float8 linears (Table 4)",
    ),
]


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the search's workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed_search(*args, **kwargs):
    wall, cpu = time.perf_counter(), cpu_seconds()
    rows = spmd.search(*args, progress=True, **kwargs)
    return rows, {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu}


def published(out: str) -> int:
    device = DEVICES["h100"].replace(name="H100 SXM 96GB", memory_bytes=96 * 2**30)
    results, lines = (
        [],
        [
            "| run | published tok/s/GPU | predicted | error | published GiB | predicted GiB | "
            "error | planned as | how they ran |",
            "|---|---|---|---|---|---|---|---|---|",
        ],
    )
    for label, model, world, spec, shape, ac, tps, gib, how in PUBLISHED:
        rows, took = timed_search(
            models.preset(model),
            world,
            device,
            batch_shape=shape,
            dtype="bf16",
            specs=[spec],
            ac=ac,
            zero=3,
            grad_accum=1,
            memory_budget_bytes=96 * 2**30,
        )
        row = (list(rows) + list(rows.dropped))[0]
        per_gpu, mem = row.tokens_per_s / world, row.memory["total"] / 2**30
        results.append(
            {
                "run": label,
                "published_tps": tps,
                "predicted_tps": per_gpu,
                "tps_error": per_gpu / tps - 1,
                "published_gib": gib,
                "predicted_gib": mem,
                "memory_error": mem / gib - 1,
                "row": row.to_dict(),
                "search": took,
                "how": how,
            }
        )
        lines.append(
            f"| {label} | {tps:,} | {per_gpu:,.0f} | {per_gpu / tps - 1:+.1%} | {gib} | {mem:.1f} | "
            f"{mem / gib - 1:+.1%} | `{row.flags}` | {how} |"
        )
    report = {"environment": common.environment(), "device": device.name, "published": results}
    markdown = (
        f"# spmd.search against torchtitan's published H100 runs\n\nAt commit "
        f"{report['environment']['commit'][:12]}; device model `h100` with 96 GB (their H100s), "
        f"efficiency {device.efficiency}. Error = predicted / published - 1.\n\n" + "\n".join(lines)
    )
    js, md = common.write(Path(out) / f"{common.today()}-search-vs-published", report, markdown)
    print(markdown, f"\nwrote {js} and {md}", sep="\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", help="PRESET or MODEL:PRESET of the model registry")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: world)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8))
    ap.add_argument("--published", action="store_true", help="plan torchtitan's published runs instead")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--against", default="", help="REV: time the search at REV and here, interleaved (search_speed)")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: runs of each tree")
    ap.add_argument("--specs", nargs="*", default=None, help="with --against: search only these specs")
    a = ap.parse_args(argv)
    if a.published:
        return published(a.out)
    cfg = models.preset(a.model)
    batch_shape = (a.batch or a.world, a.seq or min(cfg.max_seq_len, 4096))
    if a.against:
        args = dict(model=a.model, world=a.world, device=a.device, batch_shape=batch_shape, dtype=a.dtype)
        return search_speed.report(a.against, {**args, "specs": a.specs}, a.rounds, a.out)
    rows, took = timed_search(cfg, a.world, a.device, batch_shape=batch_shape, dtype=a.dtype, workers=a.workers)
    report = {"environment": common.environment(), "args": vars(a), "search": took, **rows.to_dict()}
    name = a.model.replace(":", "-")
    markdown = (
        f"# spmd.search: {name} on {a.world} x {a.device} (prediction, not a measurement)\n\n"
        f"`python -m benchmarks.search_report --model {a.model} --world {a.world} --device {a.device} "
        f"--batch {batch_shape[0]} --seq {batch_shape[1]} --workers {a.workers}` at commit "
        f"{report['environment']['commit'][:12]}: the search took {took['wall_s']:.1f} s wall clock, "
        f"{took['cpu_s']:.1f} CPU s (load average {report['environment'].get('loadavg_1m')} at start); "
        f"spmd/analysis/search.py says how compute, each collective and memory are modelled.\n\n"
        f"```\n{rows.table()}\n```"
    )
    js, md = common.write(Path(out_name(a, batch_shape)), report, markdown)
    print(f"wrote {js} and {md}")
    return 0


def out_name(a, batch_shape) -> str:
    return str(
        Path(a.out) / f"{common.today()}-search-{a.model.replace(':', '-')}-{a.world}x{a.device}-"
        f"{batch_shape[0]}x{batch_shape[1]}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
