"""Quantized wire (ZeRO++: spmd.parallelize's `comm`, the trainer's --comm-params/--comm-grads) against the
full-precision wire: the loss it trains to, and the speed where communication dominates.

    python -m benchmarks.compression --model small --steps 300 --nproc 4 --spec fsdp=4

1. Convergence: `launch.train` on the default corpus with each option (same seed, data and schedule), `--steps`
   each; the first and last loss, the mean of the last 10% of steps, and its ratio to the uncompressed run's
   (target: within 2%).
2. Throughput (`--throughput-only` runs this alone): one 4-process launch lays out the model once per option
   and times training steps (forward, backward, SGD) on a tiny batch, so the wire dominates; the options
   alternate for `--rounds` rounds of `--round-steps` steps each. Per option: tokens/s (median), its ratio to
   the uncompressed wire in the same round (median, spread (max-min)/median), and the bytes per rank per step
   the collective recorder measures.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import environment, md_table, publish, read_jsonl, run, torchrun

OPTIONS = {
    "none": {},
    "params int8": {"params": "int8"},
    "params fp8": {"params": "fp8"},
    "grads int8": {"grads": "int8"},
    "grads int4": {"grads": "int4"},
    "params int8 + grads int4": {"params": "int8", "grads": "int4"},
}
_FLAGS = {"params": "--comm-params", "grads": "--comm-grads"}


def _train(model, spec, steps, name, nproc, out):
    metrics = os.path.join(out, f"{name.replace(' ', '_')}.jsonl")
    flags = [x for k, v in OPTIONS[name].items() for x in (_FLAGS[k], v)]
    cmd = ["-m", "launch.train", "--model", model, "--mesh", spec, "--steps", str(steps), "--metrics", metrics]
    cmd += ["--warmup", str(max(1, steps // 20)), "--seq-len", "128", "--batch-size", "16", *flags]
    run(torchrun(nproc) + cmd, timeout=24 * 3600)
    losses = [r["loss"] for r in read_jsonl(metrics)]
    tail = losses[-max(1, len(losses) // 10) :]
    return {"first": losses[0], "last": losses[-1], "tail_mean": statistics.fmean(tail), "losses": losses}


def _build(model_name, spec, comm):
    import torch

    import spmd
    from models import preset

    sizes, flags = spmd.parse_spec(spec)
    torch.manual_seed(0)
    net = preset(model_name, kernels="torch").build()
    return spmd.parallelize(net, spmd.make_mesh(sizes), spmd.Rules.default(sequence_parallel="sp" in flags), comm=comm)


def _step(model, tokens):
    import torch

    model(tokens[:, :-1], tokens[:, 1:]).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-4 * p.grad
            p.grad = None


def _worker(model_name, spec, rounds, round_steps, batch, seq, out):
    """Inside torchrun: every option laid out once, timed in interleaved rounds on the same batch."""
    import torch
    import torch.distributed as dist

    from spmd.analysis.record import CollectiveRecorder

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    models = {name: _build(model_name, spec, comm or None) for name, comm in OPTIONS.items()}
    tokens = torch.randint(0, 512, (batch, seq + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    wire = {}
    for name, model in models.items():
        _step(model, tokens)  # warm-up
        with CollectiveRecorder(model._spmd_state.mesh) as rec:
            _step(model, tokens)
        wire[name] = sum(c.bytes for c in rec.records)
    seconds = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(round_steps):
                _step(model, tokens)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
            seconds[name].append(took.item())
    if dist.get_rank() == 0:
        tokens_per_round = round_steps * batch * seq * dist.get_world_size()
        rows = {n: {"tokens_per_s": [tokens_per_round / s for s in v], "bytes": wire[n]} for n, v in seconds.items()}
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _throughput(args, tmp) -> dict:
    out = os.path.join(tmp, "throughput.json")
    cmd = ["-m", "benchmarks.compression", "--worker", "--out", out, "--model", args.model, "--spec", args.spec]
    cmd += ["--rounds", str(args.rounds), "--round-steps", str(args.round_steps)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
    run(torchrun(args.nproc) + cmd, timeout=3600)
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--spec", default="fsdp=4")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank in the throughput runs")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--throughput-only", action="store_true")
    p.add_argument("--convergence-only", action="store_true")
    p.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS), metavar="NAME")
    p.add_argument("--tag", default="", help="appended to the results' name")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.spec, args.rounds, args.round_steps, args.batch, args.seq, args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        losses = {}
        if not args.throughput_only:
            losses = {name: _train(args.model, args.spec, args.steps, name, args.nproc, tmp) for name in args.options}
        speed = {} if args.convergence_only else _throughput(args, tmp)
    tag = f"-{args.tag}" if args.tag else ""
    return publish(f"compression-{args.model}{tag}", *_report(args, losses, speed))


def _report(args, losses, speed):
    parts = [f"# Quantized wire (ZeRO++) vs full precision, {args.model}, {args.spec}, {args.nproc} processes"]
    if losses:
        base = losses["none"]["tail_mean"]
        rows = [
            [n, args.steps, v["first"], v["last"], v["tail_mean"], v["tail_mean"] / base] for n, v in losses.items()
        ]
        parts.append(md_table(["comm", "steps", "first loss", "last loss", "mean of last 10%", "/ none"], rows))
    if speed:
        parts += _speed_table(args, speed)
    report = {"environment": environment(), "args": vars(args), "losses": losses, "throughput": speed}
    return report, "\n\n".join(parts)


def _speed_table(args, speed) -> list:
    base = speed["none"]
    rows = []
    for name, v in speed.items():
        ratios = [a / b for a, b in zip(v["tokens_per_s"], base["tokens_per_s"])]
        med = statistics.median(ratios)
        spread = (max(ratios) - min(ratios)) / med
        tps = statistics.median(v["tokens_per_s"])
        rows.append([name, tps, med, spread, v["bytes"], v["bytes"] / base["bytes"]])
    head = ["comm", "tokens/s", "/ none (median)", "spread", "bytes/rank/step", "bytes / none"]
    note = (
        f"Throughput: {args.rounds} interleaved rounds of {args.round_steps} steps, batch {args.batch} x "
        f"{args.seq} per rank; ratios per round against the uncompressed wire, spread (max-min)/median."
    )
    return [md_table(head, rows), note]


if __name__ == "__main__":
    sys.exit(main())
