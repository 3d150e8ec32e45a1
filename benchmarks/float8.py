"""float8 against bf16 training on one GPU: `python -m benchmarks.float8 --model 1b`.

Two copies of the model with the same initial weights in one process: `bf16` (fp32 parameters, autocast bf16,
as launch.train runs one process) and `float8` (the same, with spmd.float8_training's linear layers: torchao's
Float8Linear, tensorwise dynamic scales, float8 matmuls). Both with their blocks compiled (spmd.compile_blocks:
torchao's casts fuse only under torch.compile) and fused AdamW, on the same batches. After a warm-up that
compiles, `--rounds` interleaved rounds (the order alternates) of `--steps` steps each: tokens/s per variant
(median, min, max over rounds), the float8 / bf16 ratio as the median of the rounds' ratios with its interval
(common.median_interval), and each variant's peak memory in its steps above what both models hold
(parameters, gradients, AdamW states), plus the losses of both at the end (float8 tracks bf16, not equals).
Rounds stop early, from the second, where another would pass `--budget-s` since the start (builds and compiles
included), so the run fits one_gpu.sh's 150 s bound; the report gives the rounds run.

Needs a CUDA GPU with float8 matmuls (sm89+: H100, H200, L40S); elsewhere it stops at once with a message.
`--cpu-smoke`: the tiny model on CPU, float8 emulated, eager, a few steps: the code path, not a measurement;
it writes its report only with `--out DIR`. Writes benchmarks/results/<date>-<device>-float8-<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import common

VARIANTS = ("bf16", "float8")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.float8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b", help="registry preset (models.preset)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (the compile)")
    ap.add_argument("--budget-s", type=float, default=135, help="stop adding rounds (from the 2nd) past this")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, emulated, eager: the code path")
    ap.add_argument("--out", default="", help="directory for the .json/.md (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix of the results' name")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.model, a.batch, a.seq, a.rounds, a.steps, a.warmup, a.compile = "tiny", 2, 64, 2, 1, 1, False
    return a


def refusal(a) -> str | None:
    """Why this machine cannot run the measurement (None when it can)."""
    if a.cpu_smoke:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU with float8 matmuls (sm89+: H100, H200, L40S); on CPU run --cpu-smoke"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return f"{torch.cuda.get_device_name()} is sm{cap[0]}{cap[1]}; float8 matmuls need sm89+ (H100, H200, L40S)"
    return None


def build(a, float8: bool, device: torch.device):
    import models
    import spmd

    cfg = models.preset(a.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
    if float8:
        spmd.float8_training(model, emulate=device.type != "cuda")
    if a.compile:
        spmd.compile_blocks(model, dynamic=False)  # static shapes for both (float8 compiles static)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return cfg, model, opt


def step_fn(model, opt, device):
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(x, y) -> float:
        with amp:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # waits for the device

    return step


def timed(step, batches, device) -> dict:
    """Seconds, the last loss and the peak bytes above the memory held at the start, over `batches`."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for x, y in batches:
        loss = step(x, y)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - held if cuda else None
    return {"seconds": seconds, "loss": loss, "peak_above_held": peak}


def measure(a, device) -> dict:
    start = time.perf_counter()
    runs = {v: build(a, v == "float8", device) for v in VARIANTS}
    cfg = runs["bf16"][0]
    steps = {v: step_fn(model, opt, device) for v, (_, model, opt) in runs.items()}
    g = torch.Generator().manual_seed(0)
    total = a.warmup + a.rounds * a.steps
    tokens = torch.randint(0, cfg.vocab_size, (total, a.batch, a.seq + 1), generator=g).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    compile_s = {v: timed(steps[v], batches[: a.warmup], device)["seconds"] for v in VARIANTS}
    held = torch.cuda.memory_allocated() if device.type == "cuda" else None  # parameters and AdamW states
    rounds = []
    for r in range(a.rounds):
        chunk = batches[a.warmup + r * a.steps : a.warmup + (r + 1) * a.steps]
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        rounds.append({v: timed(steps[v], chunk, device) for v in order})
        per_round = sum(x["seconds"] for x in rounds[-1].values())
        if r >= 1 and time.perf_counter() - start + per_round > a.budget_s:
            break  # another round would pass the time budget (one_gpu.sh's bound): report the rounds run
    from spmd.float8 import float8_layers

    linears = sum(isinstance(m, torch.nn.Linear) for m in runs["bf16"][1].modules())
    return {
        "rounds": rounds,
        "compile_s": compile_s,
        "held_bytes": held,
        "float8_layers": f"{len(float8_layers(runs['float8'][1]))} of {linears}",
        "flops_per_token": cfg.flops_per_token(a.seq),
    }


def summarise(a, m: dict) -> dict:
    tokens = a.batch * a.seq * a.steps
    per = {v: [tokens / r[v]["seconds"] for r in m["rounds"]] for v in VARIANTS}
    rows = {
        v: {
            "tokens_per_s_median": statistics.median(per[v]),
            "tokens_per_s_min": min(per[v]),
            "tokens_per_s_max": max(per[v]),
            "peak_above_held_bytes": max((r[v]["peak_above_held"] or 0) for r in m["rounds"]) or None,
            "compile_and_warmup_s": m["compile_s"][v],
            "last_loss": m["rounds"][-1][v]["loss"],
        }
        for v in VARIANTS
    }
    ratio = common.median_interval([f / b for f, b in zip(per["float8"], per["bf16"])])
    return {"variants": rows, "float8_over_bf16_tokens_per_s": ratio}


def markdown(a, report: dict) -> str:
    env, res, ratio = report["environment"], report["results"], report["results"]["float8_over_bf16_tokens_per_s"]
    gib = lambda b: f"{b / 2**30:.2f}" if b else "n/a"  # noqa: E731
    rows = [
        [
            v,
            f"{r['tokens_per_s_median']:,.0f}",
            f"{r['tokens_per_s_min']:,.0f} .. {r['tokens_per_s_max']:,.0f}",
            gib(r["peak_above_held_bytes"]),
            f"{r['compile_and_warmup_s']:.1f}",
            f"{r['last_loss']:.4f}",
        ]
        for v, r in res["variants"].items()
    ]
    return "\n".join(
        [
            f"# float8 vs bf16, {a.model}, one device"
            + (" (CPU smoke: emulated, eager; not a measurement)" * a.cpu_smoke),
            "",
            f"{env['device']}, torch {env['torch']}, commit {env['commit']}{' (dirty)' if env['dirty'] else ''}, "
            f"{env['date']}. Batch {a.batch} x {a.seq} tokens, {'compiled blocks' if a.compile else 'eager'}, "
            f"autocast bf16, fused AdamW; {ratio['rounds']} interleaved rounds of {a.steps} steps after {a.warmup} "
            f"warm-up steps. float8 linear layers: {res['float8_layers']} (the output head stays bf16).",
            "",
            common.md_table(
                ["variant", "tokens/s (median)", "min .. max", "step peak GiB above held", "warm-up s", "last loss"],
                rows,
            ),
            "",
            f"float8 / bf16 tokens/s: **{ratio['median']:.3f}** [{ratio['low']:.3f}, {ratio['high']:.3f}] "
            f"({ratio['coverage']:.0%} interval over {ratio['rounds']} rounds, {ratio['verdict']}). "
            f"Both models' parameters, gradients and AdamW states held: {gib(res['held_bytes'])} GiB.",
        ]
    )


def main(argv=None) -> int:
    a = parse(argv)
    why = refusal(a)
    if why:
        print(f"benchmarks.float8: {why}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if not a.cpu_smoke else "cpu")
    m = measure(a, device)
    results = {**summarise(a, m), **{k: m[k] for k in ("held_bytes", "float8_layers", "flops_per_token")}}
    report = {"environment": common.environment(), "args": vars(a), "results": results}
    text = markdown(a, report)
    name = f"float8-{a.model}{'-' + a.tag if a.tag else ''}"
    if a.out:
        for path in common.write(Path(a.out) / f"{common.today()}-{common.device_slug()}-{name}", report, text):
            print(path)
        print(text)
        return 0
    if a.cpu_smoke:
        print(text)
        return 0
    return common.publish(name, report, text)


if __name__ == "__main__":
    sys.exit(main())
