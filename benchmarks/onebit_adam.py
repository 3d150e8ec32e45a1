"""1-bit Adam against AdamW: the loss of a model trained by launch.train with each (same data, seed, schedule
and betas), the bytes each rank puts on the wire per step before and after the warm-up, and the step time.

    python -m benchmarks.onebit_adam --model small --steps 300 --nproc 4 --spec dp=4 --onebit-warmup 30

`--repeats R` trains each optimizer R times, alternating (AdamW, 1-bit Adam, AdamW, ...); the losses are the
first repeat's (training is deterministic), the step times the median over the steps after the warm-up of
each run, and the ratio the median of the per-repeat ratios with its range. Bytes per step are the trainer's
recorded `comm_bytes` of the first step (warm-up: the gradient reduction) and of the last (compressed).
Writes results/<date>-<device>-onebit-adam-<model>.{json,md} and, with matplotlib, the loss curves beside them.
"""

import argparse
import os
import statistics
import sys
import tempfile

from benchmarks.common import RESULTS, device_slug, environment, md_table, publish, read_jsonl, run, today, torchrun

OPTIMIZERS = ("adamw", "onebit-adam")


def _train(args, optimizer: str, out: str) -> list[dict]:
    metrics = os.path.join(out, f"{optimizer}.jsonl")
    flags = ["--model", args.model, "--mesh", args.spec, "--steps", str(args.steps), "--optimizer", optimizer]
    flags += ["--onebit-warmup", str(args.onebit_warmup), "--warmup", str(max(1, args.steps // 20))]
    flags += ["--seq-len", "128", "--batch-size", "16", "--metrics", metrics]
    run(torchrun(args.nproc) + ["-m", "launch.train", *flags], timeout=24 * 3600)
    return read_jsonl(metrics)


def _summary(rows: list[dict], after: int) -> dict:
    losses = [r["loss"] for r in rows]
    tail = losses[-max(1, len(losses) // 10) :]
    kept = [r["step_time_s"] for r in rows[after:]] or [rows[-1]["step_time_s"]]
    return {
        "first": losses[0],
        "last": losses[-1],
        "tail_mean": statistics.fmean(tail),
        "step_s": statistics.median(kept),
        "bytes_first_step": rows[0]["comm_bytes"],
        "bytes_last_step": rows[-1]["comm_bytes"],
        "losses": losses,
    }


def _plot(runs: dict[str, list[dict]], name: str) -> str | None:
    try:
        from launch.plot import draw

        fig = draw(runs)
    except ImportError:
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{today()}-{device_slug()}-{name}.png"
    fig.savefig(path, dpi=110)
    return path.name


def _report(args, first: dict, ratios: list[float], plot: str | None):
    a, o = first["adamw"], first["onebit-adam"]
    rows = [
        [k, v["first"], v["last"], v["tail_mean"], v["bytes_first_step"], v["bytes_last_step"]]
        for k, v in first.items()
    ]
    md = [
        f"# 1-bit Adam vs AdamW, {args.model}, {args.spec} on {args.nproc} processes, {args.steps} steps",
        md_table(
            ["optimizer", "first loss", "last loss", "mean of last 10%", "bytes/rank step 1", "bytes/rank last"], rows
        ),
        f"Warm-up {args.onebit_warmup} exact steps. Loss of 1-bit Adam / AdamW (mean of the last 10%): "
        f"{o['tail_mean'] / a['tail_mean']:.4f}. Bytes after warm-up / AdamW's: "
        f"{o['bytes_last_step'] / a['bytes_last_step']:.4f}.",
        f"Step time after the warm-up, 1-bit Adam / AdamW: median {statistics.median(ratios):.3f} over {len(ratios)} "
        f"alternating repeat(s) (range {min(ratios):.3f}-{max(ratios):.3f}).",
    ]
    if plot:
        md.append(f"![loss]({plot})")
    report = {"environment": environment(), "args": vars(args), "runs": first, "step_time_ratios": ratios}
    return report, "\n\n".join(md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--spec", default="dp=4")
    p.add_argument("--onebit-warmup", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    first, ratios, curves = {}, [], {}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(args.repeats):
            times = {}
            for optimizer in OPTIMIZERS:
                rows = _train(args, optimizer, out)
                summary = _summary(rows, args.onebit_warmup + 1)
                times[optimizer] = summary["step_s"]
                if repeat == 0:
                    first[optimizer], curves[optimizer] = summary, rows
            ratios.append(times["onebit-adam"] / times["adamw"])
    name = f"onebit-adam-{args.model}"
    return publish(name, *_report(args, first, ratios, _plot(curves, name)))


if __name__ == "__main__":
    sys.exit(main())
