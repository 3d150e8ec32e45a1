"""Quantized wire (ZeRO++: spmd.parallelize's `comm`, the trainer's --comm-params/--comm-grads) against the
full-precision wire: the loss it trains to, and the speed where communication dominates.

    python -m benchmarks.compression --model small --steps 300 --nproc 4 --spec fsdp=4

1. Convergence: `launch.train` on the default corpus with each option (same seed, data and schedule), `--steps`
   each; the first and last loss, the mean of the last 10% of steps, and its ratio to the uncompressed run's
   (target: within 2%).
2. Throughput (`--throughput-only` runs this alone): one 4-process launch lays out the model once per option
   and times training steps (forward, backward, SGD) on a tiny batch, so the wire dominates; the options
   take turns for `--rounds` rounds of `--round-steps` steps each. `--link-mbit N` runs that launch in a
   private network namespace whose loopback `tc` throttles to N Mbit/s (every rank's traffic shares it, as
   ranks share a slow link), so communication, not this CPU, bounds the step:

       python -m benchmarks.compression --throughput-only --link-mbit 500 --rounds 9 --round-steps 2 --tag link

   Per option: tokens/s (median), its ratio to the uncompressed wire in the same round (median, 95%
   distribution-free interval), and the bytes per rank per step the collective recorder measures.
3. The convergence curves go to a PNG beside the results (benchmarks.compression_plot).
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from benchmarks.common import (
    RESULTS,
    device_slug,
    environment,
    md_table,
    median_interval,
    publish,
    read_jsonl,
    run,
    today,
    torchrun,
)

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


def _worker(args):
    """Inside torchrun: every option laid out once, timed in interleaved rounds on the same batch, each round
    starting one option later (no option always runs first)."""
    import torch
    import torch.distributed as dist

    from spmd.analysis.record import CollectiveRecorder

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    models = {name: _build(args.model, args.spec, OPTIONS[name] or None) for name in args.options}
    seed = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 512, (args.batch, args.seq + 1), generator=seed)
    wire = {}
    for name, model in models.items():
        _step(model, tokens)  # warm-up
        with CollectiveRecorder(model._spmd_state.mesh) as rec:
            _step(model, tokens)
        wire[name] = sum(c.bytes for c in rec.records)
    seconds = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.round_steps):
                _step(models[name], tokens)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
            seconds[name].append(took.item())
    if dist.get_rank() == 0:
        tokens_per_round = args.round_steps * args.batch * args.seq * dist.get_world_size()
        rows = {n: {"tokens_per_s": [tokens_per_round / s for s in v], "bytes": wire[n]} for n, v in seconds.items()}
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _throughput(args, tmp) -> dict:
    out = os.path.join(tmp, "throughput.json")
    cmd = ["-m", "benchmarks.compression", "--worker", "--out", out, "--model", args.model, "--spec", args.spec]
    cmd += ["--rounds", str(args.rounds), "--round-steps", str(args.round_steps)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--options", *args.options]
    cmd = torchrun(args.nproc) + cmd
    if args.link_mbit:  # a private network namespace: its own loopback, throttled, touching no other process
        tbf = f"tc qdisc add dev lo root tbf rate {args.link_mbit}mbit burst 1mb limit 256mb"
        cmd = ["unshare", "-rn", "sh", "-c", f"ip link set lo up && {tbf} && exec {shlex.join(cmd)}"]
    run(cmd, timeout=3600, env={"GLOO_SOCKET_IFNAME": "lo"} if args.link_mbit else None)
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
    p.add_argument("--link-mbit", type=int, default=0, help="time over a loopback throttled to this rate")
    p.add_argument("--throughput-only", action="store_true")
    p.add_argument("--convergence-only", action="store_true")
    p.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS), metavar="NAME")
    p.add_argument("--tag", default="", help="appended to the results' name")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        losses = {}
        if not args.throughput_only:
            losses = {name: _train(args.model, args.spec, args.steps, name, args.nproc, tmp) for name in args.options}
        speed = {} if args.convergence_only else _throughput(args, tmp)
    name = f"compression-{args.model}" + (f"-{args.tag}" if args.tag else "")
    report, markdown = _report(args, losses, speed)
    if losses:
        markdown += _plot({n: v["losses"] for n, v in losses.items()}, name)
    return publish(name, report, markdown)


def _plot(losses: dict, name: str) -> str:
    """The convergence curves beside the results (benchmarks.compression_plot); a markdown link, or ''."""
    try:
        from benchmarks.compression_plot import render

        path = render(losses, RESULTS / f"{today()}-{device_slug()}-{name}.png")
    except ImportError:
        print("[compression] matplotlib is not installed: no plot (pip install 'spmd[bench]')", file=sys.stderr)
        return ""
    return f"\n\n![loss per step, smoothed, and its ratio to the uncompressed run]({path.name})"


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
    base, rows = speed["none"], []
    for name, v in speed.items():
        ratio = median_interval([a / b for a, b in zip(v["tokens_per_s"], base["tokens_per_s"])])
        tps = statistics.median(v["tokens_per_s"])
        interval = f"{ratio['low']:.3f}-{ratio['high']:.3f} ({ratio['verdict']})"
        rows.append([name, tps, ratio["median"], interval, v["bytes"], v["bytes"] / base["bytes"]])
    head = ["comm", "tokens/s", "/ none (median)", "95% interval", "bytes/rank/step", "bytes / none"]
    link = f"a loopback throttled to {args.link_mbit} Mbit/s (tc tbf, all ranks' traffic)" if args.link_mbit else "gloo"
    note = (
        f"Throughput over {link}: {args.rounds} interleaved rounds of {args.round_steps} steps (forward, backward, "
        f"SGD), batch {args.batch} x {args.seq} per rank; each option's tokens/s over the uncompressed wire's in "
        "the same round, the median with its distribution-free 95% interval (benchmarks.common.median_interval)."
    )
    return [md_table(head, rows), note]


if __name__ == "__main__":
    sys.exit(main())
