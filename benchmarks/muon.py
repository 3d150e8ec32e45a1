"""Muon against AdamW: the loss of a model trained by launch.train with each (same data, seed and schedule),
and what Muon's step costs per spec.

    python -m benchmarks.muon --model small --steps 300 --nproc 4 --specs fsdp=4 dp=2,fsdp=2 fsdp=2,tp=2,sp

1. Loss: `launch.train --optimizer adamw` and `--optimizer muon` on the first spec, `--steps` each; the loss
   at the first and last step and the mean of the last 10% of steps.
2. Step cost, per spec (one 4-process launch holds every spec): one backward leaves gradients, then the
   optimizer steps of spmd.Muon and of the trainer's AdamW alternate for `--rounds` rounds; the median time
   of each, their difference (the orthogonalisation and its gathers/scatters) and its ratio to AdamW's, the
   spread of Muon's time, and the bytes each rank receives per Muon step (spmd.optim.muon_comm_bytes).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import environment, md_table, publish, read_jsonl, run, torchrun


def _train(model, spec, steps, optimizer, nproc, out):
    metrics = os.path.join(out, f"{optimizer}.jsonl")
    run(
        torchrun(nproc)
        + [
            "-m",
            "launch.train",
            "--model",
            model,
            "--mesh",
            spec,
            "--steps",
            str(steps),
            "--optimizer",
            optimizer,
            "--metrics",
            metrics,
            "--warmup",
            str(max(1, steps // 20)),
            "--seq-len",
            "128",
            "--batch-size",
            "16",
        ],
        timeout=24 * 3600,
    )
    losses = [r["loss"] for r in read_jsonl(metrics)]
    tail = losses[-max(1, len(losses) // 10) :]
    return {"first": losses[0], "last": losses[-1], "tail_mean": statistics.fmean(tail), "losses": losses}


def _worker(model_name, specs, rounds, out):
    """Inside torchrun: per spec, AdamW and Muon steps alternating on the same gradients."""
    import torch
    import torch.distributed as dist

    import spmd
    from launch.setup import adamw
    from models import preset
    from spmd.optim import muon_comm_bytes

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = []
    for spec in specs:
        sizes, flags = spmd.parse_spec(spec)
        mesh = spmd.make_mesh(sizes)
        torch.manual_seed(0)
        model = spmd.parallelize(
            preset(model_name, kernels="torch").build(), mesh, spmd.Rules.default(sequence_parallel="sp" in flags)
        )
        tokens = torch.randint(0, 512, (16 // (sizes.get("dp", 1) * sizes.get("fsdp", 1)), 129))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        cfg = argparse.Namespace(lr=1e-3, weight_decay=0.1)
        optimizers = {"adamw": adamw(model, cfg), "muon": spmd.Muon(model)}
        times = {k: [] for k in optimizers}
        for _ in range(rounds):
            for name, opt in optimizers.items():
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
        rows.append(
            {
                "spec": spec,
                "adamw_s": times["adamw"],
                "muon_s": times["muon"],
                "muon_bytes_per_rank": muon_comm_bytes(model),
            }
        )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--specs", nargs="+", default=["fsdp=4", "dp=2,fsdp=2", "fsdp=2,tp=2,sp"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.specs, args.rounds, args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        losses = {o: _train(args.model, args.specs[0], args.steps, o, args.nproc, tmp) for o in ("adamw", "muon")}
        out = os.path.join(tmp, "steps.json")
        run(
            torchrun(args.nproc)
            + [
                "-m",
                "benchmarks.muon",
                "--worker",
                "--out",
                out,
                "--model",
                args.model,
                "--rounds",
                str(args.rounds),
                "--specs",
                *args.specs,
            ],
            timeout=3600,
        )
        with open(out) as f:
            steps = json.load(f)
    return publish(f"muon-{args.model}", *_report(args, losses, steps))


def _report(args, losses, steps):
    loss_rows = [[o, args.specs[0], args.steps, v["first"], v["last"], v["tail_mean"]] for o, v in losses.items()]
    step_rows = []
    for r in steps:
        a, m = statistics.median(r["adamw_s"]), statistics.median(r["muon_s"])
        spread = (max(r["muon_s"]) - min(r["muon_s"])) / m
        step_rows.append(
            [
                r["spec"],
                1e3 * a,
                1e3 * m,
                1e3 * (m - a),
                m / a,
                spread,
                max(r["muon_bytes_per_rank"]),
                min(r["muon_bytes_per_rank"]),
            ]
        )
    md = "\n\n".join(
        [
            f"# Muon vs AdamW, {args.model}, {args.nproc} processes",
            md_table(["optimizer", "spec", "steps", "first loss", "last loss", "mean of last 10%"], loss_rows),
            md_table(
                [
                    "spec",
                    "AdamW step ms",
                    "Muon step ms",
                    "orthogonalisation ms",
                    "Muon / AdamW",
                    "Muon spread",
                    "max bytes/rank",
                    "min bytes/rank",
                ],
                step_rows,
            ),
            f"Step times: medians of {args.rounds} interleaved rounds on the same gradients; spread (max-min)/median.",
        ]
    )
    report = {"environment": environment(), "args": vars(args), "losses": losses, "steps": steps}
    return report, md


if __name__ == "__main__":
    sys.exit(main())
