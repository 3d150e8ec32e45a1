"""MFU per sharding spec, with the baselines measured in the same run.

    python -m benchmarks.mfu --model tiny --nproc 4 --specs "fsdp=4" "fsdp=2,tp=2,sp" "tp=4" \
        [--steps 10] [--warmup 3] [--dtype fp32] [--compile] [--seq-len 128] [--batch-size 8] [--rounds 5] \
        [--zero 1 2] [--offload optimizer]

Interleaved rounds (A B A B ...): each round runs, in turn,
  spmd     torchrun -m launch.train --mesh SPEC          (our trainer; JSONL metrics)
  native   torchrun -m benchmarks.native_train --mesh SPEC  (fully_shard + parallelize_module, torchtitan's way)
and `single`, plain PyTorch on one device (launch.train with one process), same model, global batch,
data, initialisation and optimizer. Warmup steps are discarded; a run's step time, tokens/s and MFU are
medians of the rest, peak memory the maximum; a row shows the run of median tokens/s over the rounds.
spmd / native tokens/s is computed per round and reported as its median and range over the rounds: a
range that covers 1.0 is "even", not a win or a loss. Speed claims are these ratios from one run, never
absolute numbers across runs. Losses must agree across the three (same data,
same initial weights): the report shows the largest difference.

Writes benchmarks/results/<date>-<device>-<model>.{json,md,png} (the PNG needs matplotlib).
On CPU a "device" is one process; torchrun gives each process one thread; MFU uses this machine's measured
GEMM peak (launch.metrics). `--compile` compiles every trainer's blocks (spmd.compile_blocks; torch.compile
per block for native) and adds an eager spmd row per spec, so compiled / eager is measured in the same run.
`--zero 1 2` adds a spmd row per spec with an fsdp axis and ZeRO stage (the `spmd` row is the trainer's
default, stage 3), with its tokens/s and peak memory from the same run; `--offload optimizer` runs those rows
offloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import common


def trainer_args(a, spec: str | None) -> list[str]:
    out = [
        "--model",
        a.model,
        "--steps",
        str(a.steps),
        "--batch-size",
        str(a.batch_size),
        "--seq-len",
        str(a.seq_len),
        "--dtype",
        a.dtype,
        "--seed",
        "0",
        "--lr",
        str(a.lr),
        "--warmup",
        str(a.lr_warmup),
    ]
    if spec is not None:
        sizes = ",".join(p for p in spec.split(",") if p.strip() != "sp")
        out += ["--mesh", sizes] + (["--sp"] if "sp" in [p.strip() for p in spec.split(",")] else [])
    return out


def run_spmd(a, spec: str | None, jsonl: Path, flags: set, compile_: bool | None = None, extra=()) -> dict:
    cmd = (common.torchrun(a.nproc) if spec else [sys.executable]) + ["-m", "launch.train"] + trainer_args(a, spec)
    cmd += ["--metrics", str(jsonl), *extra]
    notes = []
    if a.compile if compile_ is None else compile_:
        if "--compile" in flags:
            cmd.append("--compile")
        else:
            notes.append("eager: launch.train has no --compile")
    if a.kernels:
        if "--kernels" in flags:
            cmd += ["--kernels", a.kernels]
        else:
            notes.append("launch.train has no --kernels")
    # one CPU "device" is one process with one thread, as torchrun gives each rank (and 2 OpenMP threads
    # spinning against other processes on a busy machine can be 10x slower than one)
    env = {"OMP_NUM_THREADS": "1"} if spec is None else None
    common.run(cmd, timeout=a.timeout, env=env)
    return {"rows": common.read_jsonl(jsonl), "notes": notes}


def run_native(a, spec: str, jsonl: Path) -> dict:
    cmd = common.torchrun(a.nproc) + ["-m", "benchmarks.native_train"] + trainer_args(a, spec)
    cmd += ["--metrics", str(jsonl)]
    if a.compile:
        cmd.append("--compile")
    if a.kernels:
        cmd += ["--kernels", a.kernels]
    common.run(cmd, timeout=a.timeout)
    side = Path(str(jsonl) + ".comm.json")
    count = json.loads(side.read_text())["collectives_per_step"] if side.is_file() else None
    return {"rows": common.read_jsonl(jsonl), "notes": [], "collectives": count}


def planned_collectives(a, spec: str) -> int:
    """Collectives of one forward + backward of our layout, from spmd.explain (the trainer's clipping adds 1-2)."""
    import torch

    import spmd
    from models.llama import Llama, LlamaConfig

    sizes, flags = spmd.parse_spec(spec)
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset(a.model))
    plan = spmd.explain(
        model,
        spmd.Rules.default(sequence_parallel="sp" in flags),
        sizes,
        batch_shape=(a.batch_size, a.seq_len),
        dtype=a.dtype,
    )
    return len(plan.collectives)


def _schedule(a) -> list[tuple[str, str | None]]:
    """One round's runs, in order: the single-device baseline, then per spec spmd (eager), native."""
    order = [] if a.no_single else [("single", None)]
    for spec in a.specs:
        order.append(("spmd", spec))
        order += [(f"zero{stage}", spec) for stage in _zero_stages(a, spec)]
        if a.compile:
            order.append(("eager", spec))
        if not a.no_native:
            order.append(("native", spec))
    return order


def _zero_stages(a, spec: str) -> list[int]:
    """The ZeRO stages with rows of their own on `spec` (stage 3 is the trainer's default: the spmd row); none
    on a mesh without an fsdp axis, where every stage is plain data parallelism."""
    from spmd.layout.mesh import parse_spec

    return [z for z in a.zero if z != 3] if "fsdp" in parse_spec(spec)[0] else []


def _zero_flags(a, kind: str) -> list[str]:
    if not kind.startswith("zero"):
        return []
    return ["--zero", kind[len("zero") :]] + (["--offload", a.offload] if a.offload else [])


def _median_run(summaries: list[dict]) -> dict:
    """The round with the median tokens/s (its losses, memory and comm come with it)."""
    ranked = sorted(summaries, key=lambda s: s["tokens_per_s"])
    return {**ranked[len(ranked) // 2], "rounds": len(ranked)}


def ratio_stats(ratios: list[float]) -> dict:
    """Median and range of per-round ratios; "even" when the range covers 1.0, as no ordering is shown then."""
    lo, hi = min(ratios), max(ratios)
    verdict = "even" if lo <= 1.0 <= hi else ("faster" if lo > 1.0 else "slower")
    return {
        "median": statistics.median(ratios),
        "min": lo,
        "max": hi,
        "rounds": len(ratios),
        "verdict": verdict,
        "per_round": ratios,
    }


def summarize(result: dict, warmup: int) -> dict:
    s = common.steady(result["rows"], warmup)
    s["losses"] = [r["loss"] for r in result["rows"]]
    s["notes"] = result.get("notes", [])
    s["collectives"] = result.get("collectives")
    return s


def markdown(rep: dict) -> str:
    env = rep["environment"]
    a = rep["args"]
    lines = [
        f"# MFU per spec: {a['model']} on {a['nproc']} x {env['device']}",
        "",
        f"{env['date']}, torch {env['torch']}, {env['cpu_count']} cores, load average "
        f"{env.get('loadavg_1m', float('nan')):.1f} at start, {rep.get('loadavg_1m_at_end') or float('nan'):.1f} "
        f"at the end; one CPU device = one process with one thread (the single-device baseline too); "
        f"global batch {a['batch_size']} x {a['seq_len']}, "
        f"{a['dtype']}{', --compile' if a['compile'] else ''}; {a['steps']} steps, first {a['warmup']} discarded; "
        f"medians of the rest; {a['rounds']} interleaved rounds. Peak FLOP/s per device: {rep.get('peak', 'n/a')}.",
        "",
        "| spec | impl | tokens/s | MFU | step time s | peak mem/rank MiB | comm bytes/rank/step | collectives/step "
        "| spmd / native tok/s: median [range] over rounds | spmd / single tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    single = rep.get("single")
    if single:
        lines.append(
            f"| 1 device | plain PyTorch | {single['tokens_per_s']:,.0f} | {100 * single['mfu']:.3f}% | "
            f"{single['step_time_s']:.4f} | {single['peak_mem_bytes'] / 2**20:,.0f} | 0 | 0 | | |"
        )
    for r in rep["rows"]:
        ours, nat = r["spmd"], r.get("native")
        v = r.get("vs_native")
        ratio_n = f"{v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}] {v['verdict']}" if v else "n/a"
        ratio_s = f"{ours['tokens_per_s'] / single['tokens_per_s']:.3f}" if single else "n/a"
        note = f" ({'; '.join(ours['notes'])})" if ours["notes"] else ""
        lines.append(
            f"| {r['spec']} | spmd{note} | {ours['tokens_per_s']:,.0f} | {100 * ours['mfu']:.3f}% | "
            f"{ours['step_time_s']:.4f} | {ours['peak_mem_bytes'] / 2**20:,.0f} | {ours['comm_bytes']:,.0f} | "
            f"{r.get('planned_collectives', '')}+ | {ratio_n} | {ratio_s} |"
        )
        for stage, z in r.get("zero", {}).items():
            lines.append(
                f"| {r['spec']} | spmd --zero {stage}{' --offload ' + a['offload'] if a['offload'] else ''} | "
                f"{z['tokens_per_s']:,.0f} | {100 * z['mfu']:.3f}% | {z['step_time_s']:.4f} | "
                f"{z['peak_mem_bytes'] / 2**20:,.0f} | {z['comm_bytes']:,.0f} | | | "
                f"zero {stage} / 3: {z['tokens_per_s'] / ours['tokens_per_s']:.3f} |"
            )
        eager = r.get("spmd_eager")
        if eager:
            lines.append(
                f"| {r['spec']} | spmd eager | {eager['tokens_per_s']:,.0f} | {100 * eager['mfu']:.3f}% | "
                f"{eager['step_time_s']:.4f} | {eager['peak_mem_bytes'] / 2**20:,.0f} | "
                f"{eager['comm_bytes']:,.0f} | | compiled / eager: "
                f"{ours['tokens_per_s'] / eager['tokens_per_s']:.3f} | |"
            )
        if nat:
            lines.append(
                f"| {r['spec']} | native | {nat['tokens_per_s']:,.0f} | {100 * nat['mfu']:.3f}% | "
                f"{nat['step_time_s']:.4f} | {nat['peak_mem_bytes'] / 2**20:,.0f} | "
                f"{nat['comm_bytes']:,.0f}* | {nat.get('collectives') or ''}* | | |"
            )
    lines += [
        "",
        f"Largest loss difference between spmd, native and single over all steps: {rep['max_loss_diff']:.2e}.",
        "",
        "*native: what spmd's dispatch-mode recorder sees of the step (DTensor's, FSDP2's flat all-gathers and "
        "reduce-scatters, DDP's bucket all-reduces), by the same ring convention. +spmd: collectives of forward "
        "+ backward planned by spmd.explain, plus 0-2 small all-reduces of the gradient-norm clipping.",
        "On CPU, peak memory is each process's peak resident set (the whole interpreter), not tensors alone.",
        f"Spread of step times after warmup (max-min)/median, worst row: {rep['max_spread']:.2f}.",
    ]
    if rep.get("png"):
        lines += ["", f"![MFU per spec]({Path(rep['png']).name})"]
    return "\n".join(lines)


def plot(rep: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[mfu] matplotlib is not installed: no PNG (pip install matplotlib)", flush=True)
        return None
    specs = [r["spec"] for r in rep["rows"]]
    ours = [100 * r["spmd"]["mfu"] for r in rep["rows"]]
    nat = [100 * r["native"]["mfu"] if r.get("native") else 0 for r in rep["rows"]]
    fig, ax = plt.subplots(figsize=(1.6 * len(specs) + 2.5, 3.8))
    xs = range(len(specs))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="spmd")
    ax.bar([x + 0.2 for x in xs], nat, 0.4, label="native (fully_shard + parallelize_module)")
    if rep.get("single"):
        ax.axhline(100 * rep["single"]["mfu"], color="gray", ls="--", label="1 device, plain PyTorch")
    ax.set_xticks(list(xs), specs)
    ax.set_ylabel("MFU (%)")
    a = rep["args"]
    ax.set_title(
        f"{a['model']}, {a['nproc']} x {rep['environment']['device'][:28]}, {a['dtype']}, "
        f"batch {a['batch_size']}x{a['seq_len']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--specs", nargs="+", default=["fsdp=4", "fsdp=2,tp=2,sp", "tp=4"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps discarded before the medians")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (both trainers)")
    ap.add_argument("--lr-warmup", type=int, default=5, help="learning-rate warmup steps (both trainers)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--kernels", default="", help="auto|torch|triton, passed where supported")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds: each round runs every implementation of every spec once",
    )
    ap.add_argument("--zero", type=int, nargs="*", default=[], help="ZeRO stages with a row each (3: the spmd row)")
    ap.add_argument("--offload", default="", help="optimizer: the --zero rows offload AdamW to the host")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--no-single", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--tag", default="", help="suffix of the result files")
    a = ap.parse_args(argv)
    if a.warmup >= a.steps:
        ap.error(f"--warmup {a.warmup} must be smaller than --steps {a.steps}")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < a.nproc:
        ap.error(f"--nproc {a.nproc} but only {torch.cuda.device_count()} GPUs")
    flags = common.trainer_flags()
    rep = {"environment": common.environment(), "args": vars(a), "rows": [], "trainer_flags": sorted(flags)}
    rep["rows"] = [{"spec": spec, "planned_collectives": planned_collectives(a, spec)} for spec in a.specs]
    runs = {}  # (kind, spec) -> one summary per round
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(a.rounds):
            # A B A B: every implementation of every spec runs once per round, so a drift of the machine's
            # load hits each alike, and each round gives one spmd / native ratio measured minutes apart at most
            for kind, spec in _schedule(a):
                print(f"[mfu] round {round_ + 1}/{a.rounds}: {spec or 'single device'}: {kind}", flush=True)
                path = Path(tmp, f"{kind}-{round_}.jsonl")
                res = (
                    run_native(a, spec, path)
                    if kind == "native"
                    else run_spmd(a, spec, path, flags, False if kind == "eager" else None, _zero_flags(a, kind))
                )
                runs.setdefault((kind, spec), []).append(summarize(res, a.warmup))
    if not a.no_single:
        rep["single"] = _median_run(runs[("single", None)])
    for row in rep["rows"]:
        for kind, key in (("spmd", "spmd"), ("eager", "spmd_eager"), ("native", "native")):
            if (kind, row["spec"]) in runs:
                row[key] = _median_run(runs[(kind, row["spec"])])
        for stage in _zero_stages(a, row["spec"]):
            row.setdefault("zero", {})[stage] = _median_run(runs[(f"zero{stage}", row["spec"])])
        if "native" in row:
            row["vs_native"] = ratio_stats(
                [
                    o["tokens_per_s"] / n["tokens_per_s"]
                    for o, n in zip(runs[("spmd", row["spec"])], runs[("native", row["spec"])])
                ]
            )
            v = row["vs_native"]
            print(
                f"[mfu] {row['spec']}: spmd / native tokens/s {v['median']:.3f} "
                f"[{v['min']:.3f}, {v['max']:.3f}] over {v['rounds']} rounds: {v['verdict']}",
                flush=True,
            )
    losses = [r[k]["losses"] for r in rep["rows"] for k in ("spmd", "spmd_eager", "native") if k in r]
    losses += [z["losses"] for r in rep["rows"] for z in r.get("zero", {}).values()]
    if rep.get("single"):
        losses.append(rep["single"]["losses"])
    rep["max_loss_diff"] = max((abs(x - y) for l1 in losses for l2 in losses for x, y in zip(l1, l2)), default=0.0)
    rep["max_spread"] = max(
        [r[k]["step_time_spread"] for r in rep["rows"] for k in ("spmd", "spmd_eager", "native") if k in r]
        + ([rep["single"]["step_time_spread"]] if rep.get("single") else [])
    )
    try:
        from launch.metrics import peak_flops

        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # one CPU device = one single-threaded process, as the runs' own MFU uses
        peak, source = peak_flops(a.dtype, "cuda" if torch.cuda.is_available() else "cpu")
        rep["peak"] = f"{peak / 1e12:.4g} TFLOP/s ({source.split(',')[0]})"
    except Exception as e:  # noqa: BLE001
        rep["peak"] = f"unknown ({e})"
    stem = Path(a.out) / (f"{common.today()}-{common.device_slug()}-{a.model}" + (f"-{a.tag}" if a.tag else ""))
    stem.parent.mkdir(parents=True, exist_ok=True)
    rep["png"] = plot(rep, stem.with_suffix(".png"))
    rep["loadavg_1m_at_end"] = common.environment().get("loadavg_1m")
    js, md = common.write(stem, rep, markdown(rep))
    print(f"[mfu] wrote {js}, {md}" + (f", {rep['png']}" if rep["png"] else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
