"""The cost of the abstraction: a training step of `spmd.parallelize` on a 1-process mesh against the same
model as plain PyTorch (same dtype, same compile setting), and where the difference goes.

    python -m benchmarks.overhead [--models tiny small] [--steps 10] [--dtype fp32] [--compile] [--batch 8 --seq 128]
                                  [--native] [--per-block]

At `--batch 1 --seq 16` the kernels take little time and the ratio is that of the host work, what a GPU step
waits on when its kernels are short.

Variants, each a full step (forward, backward, AdamW) on the same batch, timed after warmup, interleaved
round by round (the order rotated each round) so load drifts hit every variant alike; each ratio to plain is the
median of the rounds' ratios with its 95% distribution-free interval (common.median_interval), "even" where
that covers 1:
  plain            the model as plain PyTorch
  plain+recorder   plain under spmd.analysis.record.CollectiveRecorder (the dispatch mode launch.train wraps each step
  in)
  spmd             spmd.parallelize on a 1-process mesh (every mesh axis of size 1: nothing moves, no collective,
                   and the whole model runs on local tensors)
  spmd+recorder    what launch.train runs on one rank of a mesh
  spmd-blocks      with --per-block: spmd's per-block path on the same mesh (each block on local tensors with its own
                   hooks, the model's code between them on DTensors), what each rank of a mesh with data axes runs;
                   on a mesh of one rank spmd runs the whole model on local tensors instead
                   (spmd.runtime.local.whole_model)
  ddp, fsdp2       with --native: torch's own wrappers on the same 1-process group, DistributedDataParallel and
                   fully_shard per block then the root (benchmarks.native_train's layouts): what torch-native
                   costs per step where nothing needs to move, the reference spmd's `dp` and `fsdp` specs face
Then a cProfile of the spmd steps, its time split by where the Python runs (DTensor dispatch and sharding
propagation, DTensor redistribute, spmd's hooks and moves, nn.Module call machinery, autograd, the optimizer,
native kernels), and counts per step: DTensor op dispatches, redistribute calls, parameter gathers.
Writes benchmarks/results/<date>-<device>-overhead[-<tag>].{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from benchmarks import common

CATEGORIES = [  # (name, predicate on the profiled function's file path); first match wins
    ("DTensor redistribute", lambda f: "torch/distributed/tensor/_redistribute" in f or "_collective_utils" in f),
    ("DTensor dispatch + sharding propagation", lambda f: "torch/distributed/tensor" in f),
    ("spmd recorder (dispatch mode)", lambda f: "spmd/record" in f or "_python_dispatch" in f),
    ("spmd hooks, moves, constrain", lambda f: "/spmd/" in f),
    ("kernels (model's ops)", lambda f: "/kernels/" in f or "/models/" in f),
    ("nn.Module call + hooks", lambda f: "torch/nn/modules/module.py" in f),
    ("optimizer", lambda f: "torch/optim" in f),
    ("autograd (Python side)", lambda f: "torch/autograd" in f or "torch/_tensor.py" in f),
    ("native ops (C++ builtins)", lambda f: f.startswith("~") or f.startswith("<built-in")),
]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


NATIVE = ["ddp", "fsdp2"]


def build(model_name: str, variant: str, dtype: str, compile_: bool = False):
    """(config, model, optimizer) of one variant; `compile_`: each block one compiled graph (before a native
    wrapper goes on, as torchtitan compiles before fully_shard)."""
    import spmd
    from models.llama import Llama, LlamaConfig

    cfg = LlamaConfig.preset(model_name)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Llama(cfg)
    param_dtype = {"fp32": None, "bf16": torch.bfloat16}[dtype]
    if variant.startswith("spmd") or variant in NATIVE:
        mesh = spmd.make_mesh({"dp": 1}, device_type=DEVICE.type)
    if variant.startswith("spmd"):
        spmd.parallelize(model, mesh, spmd.Rules.default(), param_dtype=param_dtype)
    if variant == "spmd-blocks":
        from spmd.runtime.local.whole_model import drop_local_model
        from spmd.runtime.state import STATE_ATTR

        drop_local_model(model, getattr(model, STATE_ATTR))
    if compile_:
        spmd.compile_blocks(model)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif variant == "fsdp2":
        from benchmarks.native_train import apply_fsdp

        apply_fsdp(model, mesh, dtype == "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the trainer's (launch.setup.adamw)
    return cfg, model, opt


def step_fn(model, opt, x, y, variant: str, dtype: str):
    from spmd.analysis.record import CollectiveRecorder

    autocast = dtype == "bf16" and (variant.startswith("plain") or variant == "ddp")

    def step():
        rec = CollectiveRecorder() if variant.endswith("recorder") else contextlib.nullcontext()
        amp = torch.autocast(DEVICE.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with rec:
            with amp:
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # waits for the device

    return step


def profile(step, steps: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in stats.stats.values())  # tottime
    by_cat = {name: 0.0 for name, _ in CATEGORIES}
    by_cat["other Python"] = 0.0
    calls = {
        "DTensor output wraps (Python)": 0,
        "redistribute calls": 0,
        "parameter gathers (gather_param)": 0,
        "module forward calls": 0,
        "aten ops via dispatch (Python __torch_dispatch__)": 0,
    }
    for (file, _line, func), (_cc, nc, tt, _ct, _callers) in stats.stats.items():
        for name, pred in CATEGORIES:
            if pred(file):
                by_cat[name] += tt
                break
        else:
            by_cat["other Python"] += tt
        if file.endswith("tensor/_dispatch.py") and func == "wrap":
            calls["DTensor output wraps (Python)"] += nc
        elif file.endswith("tensor/_api.py") and func == "redistribute":
            calls["redistribute calls"] += nc
        elif file.endswith("spmd/runtime/parameters/gather.py") and func == "gather_param":
            calls["parameter gathers (gather_param)"] += nc
        elif file.endswith("nn/modules/module.py") and func == "_call_impl":
            calls["module forward calls"] += nc
        elif func == "__torch_dispatch__":
            calls["aten ops via dispatch (Python __torch_dispatch__)"] += nc
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]
    return {
        "profiled_s_per_step": total / steps,
        "share": {k: v / total for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "calls_per_step": {k: v / steps for k, v in calls.items()},
        "top_functions": [
            {
                "where": f"{f.split('site-packages/')[-1]}:{l}({fn})",
                "tottime_per_step": tt / steps,
                "calls_per_step": nc / steps,
            }
            for (f, l, fn), (cc, nc, tt, ct, _) in top
        ],
    }


class _OpCounter:
    """Counts, per step, the ops DTensor dispatches (any DTensor argument) and the aten ops on plain tensors."""

    def __init__(self):
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(issubclass(t, DTensor) for t in types):
                    counter.dtensor += 1
                    return NotImplemented
                counter.aten += 1
                return func(*args, **(kwargs or {}))

        self.mode, self.dtensor, self.aten = Mode(), 0, 0


def count_ops(step) -> dict:
    c = _OpCounter()
    with c.mode:
        step()
    return {"DTensor ops": c.dtensor, "aten ops on local tensors": c.aten}


def dtensor_op_overhead(reps: int = 3000) -> dict:
    """Seconds per op of DTensor's eager dispatch on a 1-process mesh beyond the plain op, for an add on
    [8, 128, 64] and a linear [8, 128, 64] x [64, 64]: the per-op price the step pays."""
    from torch.distributed.tensor import DTensor, Replicate

    import spmd

    mesh = spmd.make_mesh({"dp": 1}, device_type=DEVICE.type)
    x, w = torch.randn(8, 128, 64, device=DEVICE), torch.randn(64, 64, device=DEVICE)
    dx, dw = (DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (x, w))
    out = {}
    for name, plain, dt in (
        ("add", lambda: x + x, lambda: dx + dx),
        ("linear", lambda: torch.nn.functional.linear(x, w), lambda: torch.nn.functional.linear(dx, dw)),
    ):
        best = {}
        for label, fn in (("plain", plain), ("dtensor", dt)):
            fn()
            samples = []
            for _ in range(5):
                _sync()
                t0 = time.perf_counter()
                for _ in range(reps // 5):
                    fn()
                _sync()
                samples.append((time.perf_counter() - t0) / (reps // 5))
            best[label] = min(samples)
        out[name] = {
            "plain_s": best["plain"],
            "dtensor_s": best["dtensor"],
            "overhead_s": best["dtensor"] - best["plain"],
        }
    return out


def measure(
    model_name: str,
    dtype: str,
    steps: int,
    warmup: int,
    variants: list[str],
    compile_: bool,
    batch: int = 8,
    seq: int = 128,
    profiled: bool = True,
) -> dict:
    from launch.metrics import flops_per_token

    built, models = {}, {}
    for v in variants:
        # a recorder variant steps its base variant's model: the same work, one model less in memory
        # (six fp32 1B models with AdamW state do not fit one 80 GB GPU)
        base = v.removesuffix("+recorder")
        if base not in models:
            models[base] = build(model_name, base, dtype, compile_)  # the same compile setting for every variant
        cfg, model, opt = models[base]
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(DEVICE)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        built[v] = step_fn(model, opt, x, y, v, dtype)
    losses, errors = {}, {}
    for v in list(variants):  # the first steps compile (with --compile); a variant that fails is reported
        try:
            for _ in range(max(1, warmup)):
                losses[v] = built[v]()
        except Exception as e:  # noqa: BLE001
            import traceback

            ours = [
                f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                for f in traceback.extract_tb(e.__traceback__)
                if str(common.ROOT) in f.filename
            ]
            # dynamo lists the user code it was tracing in the message, not in the traceback
            ours += [
                line.strip().replace(str(common.ROOT) + "/", "")
                for line in str(e).splitlines()
                if str(common.ROOT) in line and line.strip().startswith("File")
            ]
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" + (
                f" (last frames in this repository: {' <- '.join(reversed(ours[-3:]))})" if ours else ""
            )
            variants.remove(v)
    if "plain" not in variants:
        raise RuntimeError(f"plain variant failed: {errors}")
    times = {v: [] for v in variants}
    for r in range(steps):  # each round runs every variant once, the order rotated so none always goes first
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            t0 = time.perf_counter()
            built[v]()
            times[v].append(time.perf_counter() - t0)
    out = {
        "model": model_name,
        "dtype": dtype,
        "compile": compile_,
        "batch": [batch, seq],
        "times": times,
        "threads": torch.get_num_threads(),
        **_summary(times),
        "loss_after_warmup": losses,
        "errors": errors,
        "flops_per_step": flops_per_token(cfg, seq) * batch * seq,
    }
    if profiled and not compile_ and "spmd" in built:
        out["profile_spmd"] = profile(built["spmd"], max(3, steps // 2))
        out["profile_plain"] = profile(built["plain"], max(3, steps // 2))
        out["ops_spmd"] = count_ops(built["spmd"])
        out["ops_plain"] = count_ops(built["plain"])
    return out


def _summary(times: dict) -> dict:
    """Median step per variant, and each ratio to plain as the median of the rounds' ratios (each round's two
    steps ran back to back) with its interval, which says whether an ordering is shown."""
    med = {v: statistics.median(t) for v, t in times.items()}
    intervals = {v: common.median_interval([a / b for a, b in zip(t, times["plain"])]) for v, t in times.items()}
    out = {
        "step_s": med,
        "spread": {v: (max(t) - min(t)) / med[v] for v, t in times.items()},
        "ratio_to_plain": {v: i["median"] for v, i in intervals.items()},
        "ratio_interval": intervals,
    }
    if "spmd" in times and any(v in times for v in NATIVE):  # spmd against each native wrapper, round by round
        out["spmd_over_native"] = {
            v: common.median_interval([a / b for a, b in zip(times["spmd"], times[v])]) for v in NATIVE if v in times
        }
    return out


def measure_in_processes(processes: int, *args) -> dict:
    """`measure` in `processes` fresh interpreters one after another, their rounds pooled: a process's memory
    layout moves its kernels' speed, so one process's interval understates how far a rerun lands. The first
    process profiles; each process's own spmd / plain median is kept."""
    if processes == 1:
        return measure(*args)
    import multiprocessing

    runs = []
    for i in range(processes):
        # the child's torch threads as this process's (a fresh interpreter would take every core)
        with multiprocessing.get_context("spawn").Pool(1, torch.set_num_threads, (torch.get_num_threads(),)) as pool:
            runs.append(pool.apply(measure, args, {"profiled": i == 0}))
            pool.close()  # the worker exits by itself, its compile workers' resources released
            pool.join()
    pooled = {v: [t for r in runs for t in r["times"][v]] for v in runs[0]["times"]}
    per_process = {v: [r["ratio_to_plain"][v] for r in runs] for v in runs[0]["times"]}
    return {**runs[0], "times": pooled, **_summary(pooled), "processes": processes, "ratio_per_process": per_process}


def markdown(rep: dict) -> str:
    env = rep["environment"]
    lines = [
        "# Overhead of spmd.parallelize on a 1-process mesh vs plain PyTorch",
        "",
        f"{env['date']}, {env['device']}, torch {env['torch']}, {rep['args']['threads']} threads, load average "
        f"{env.get('loadavg_1m', float('nan')):.1f} at start. Full training steps (forward, backward, AdamW) "
        f"on batch {rep['args']['batch']} x {rep['args']['seq']}; medians of interleaved rounds (the order rotated "
        f"each round). A ratio is the median of the rounds' ratios, with its 95% distribution-free interval; "
        f'"even" where that covers 1.'
        + (
            f" Each row pools the rounds of {rep['args'].get('processes', 1)} fresh processes run one after another."
            if rep["args"].get("processes", 1) > 1
            else ""
        ),
        "",
        "| model | dtype | compile | plain s | plain+recorder s | spmd s | spmd+recorder s | spmd / plain | "
        "recorder / plain | spmd+recorder / plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["runs"]:
        s, q = r["step_s"], r["ratio_to_plain"]

        def cell(d, k, fmt):  # compiled runs measure plain and spmd only
            return format(d[k], fmt) if k in d else "-"

        spmd = r.get("ratio_interval", {}).get("spmd")
        ratio = (
            f"{spmd['median']:.3f} [{spmd['low']:.3f}, {spmd['high']:.3f}] {spmd['verdict']}"
            if spmd
            else cell(q, "spmd", ".2f")
        )
        lines.append(
            f"| {r['model']} | {r['dtype']} | {'per block' if r['compile'] else 'no'} | {s['plain']:.4f} | "
            f"{cell(s, 'plain+recorder', '.4f')} | {cell(s, 'spmd', '.4f')} | "
            f"{cell(s, 'spmd+recorder', '.4f')} | {ratio} | "
            f"{cell(q, 'plain+recorder', '.2f')} | {cell(q, 'spmd+recorder', '.2f')} |"
        )
    lines += _per_block_table(rep["runs"]) + _native_table(rep["runs"])
    per_process = [
        f"{r['model']} {'compiled' if r['compile'] else 'eager'} "
        + ", ".join(f"{x:.3f}" for x in r["ratio_per_process"]["spmd"])
        for r in rep["runs"]
        if "spmd" in r.get("ratio_per_process", {})
    ]
    if per_process:
        lines += ["", "spmd / plain in each process: " + "; ".join(per_process) + "."]
    for r in rep["runs"]:
        if "profile_spmd" not in r:
            continue
        p, pp = r["profile_spmd"], r["profile_plain"]
        lines += [
            "",
            f"## Where the spmd step's time goes: {r['model']} {r['dtype']} (cProfile, self time)",
            "",
            f"Profiled step: spmd {p['profiled_s_per_step']:.4f} s, plain {pp['profiled_s_per_step']:.4f} s "
            f"(cProfile inflates Python-heavy code; read the shares, not the absolute times).",
            "",
            "| where | share of spmd step | share of plain step |",
            "|---|---|---|",
        ]
        for k, v in p["share"].items():
            lines.append(f"| {k} | {100 * v:.1f}% | {100 * pp['share'].get(k, 0):.1f}% |")
        lines += ["", "| per step | spmd | plain |", "|---|---|---|"]
        for k in r["ops_spmd"]:
            lines.append(f"| {k} | {r['ops_spmd'][k]:,} | {r['ops_plain'][k]:,} |")
        for k, v in p["calls_per_step"].items():
            lines.append(f"| {k} | {v:,.0f} | {pp['calls_per_step'].get(k, 0):,.0f} |")
    if rep.get("findings"):
        lines += ["", "## Findings", ""] + [f"- {f}" for f in rep["findings"]]
    return "\n".join(lines)


def _interval(i: dict) -> str:
    return f"{i['median']:.3f} [{i['low']:.3f}, {i['high']:.3f}] {i['verdict']}"


def _per_block_table(runs: list) -> list[str]:
    """spmd's per-block path on the same one-rank mesh: what a rank of a mesh with data axes pays per step."""
    rows = [r for r in runs if "spmd-blocks" in r.get("ratio_interval", {})]
    if not rows:
        return []
    lines = [
        "",
        "spmd's per-block path on the same mesh (each block on local tensors with its own hooks, the model's "
        "code between them on DTensors: what each rank of a mesh with data axes runs), in the same rounds:",
        "",
        "| model | compile | per block s | per block / plain |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {'per block' if r['compile'] else 'no'} | {r['step_s']['spmd-blocks']:.4f} | "
            f"{_interval(r['ratio_interval']['spmd-blocks'])} |"
        )
    return lines


def _native_table(runs: list) -> list[str]:
    """Torch's own wrappers on the same 1-process group: their cost over plain, and spmd's against them."""
    rows = [r for r in runs if "spmd_over_native" in r]
    if not rows:
        return []
    lines = [
        "",
        "Torch-native wrappers on the same 1-process group (DistributedDataParallel; fully_shard per block, "
        "then the root), in the same interleaved rounds:",
        "",
        "| model | compile | DDP / plain | FSDP2 / plain | spmd / DDP | spmd / FSDP2 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [_interval(r["ratio_interval"][v]) if v in r["ratio_interval"] else "-" for v in NATIVE]
        cells += [_interval(r["spmd_over_native"][v]) if v in r["spmd_over_native"] else "-" for v in NATIVE]
        lines.append(f"| {r['model']} | {'per block' if r['compile'] else 'no'} | " + " | ".join(cells) + " |")
    return lines


def findings(rep: dict) -> list[str]:
    out = []
    for r in rep["runs"]:
        q = r["ratio_to_plain"]
        if "spmd" not in q:
            out.append(
                f"{r['model']} {r['dtype']}{' compiled' if r['compile'] else ''}: plain {r['step_s']['plain']:.4f} s; "
                f"spmd failed: {r['errors'].get('spmd', '?')}"
            )
            continue
        native = "".join(
            f"; {v.upper()} {q[v]:.2f}x plain, spmd {r['spmd_over_native'][v]['median']:.2f}x {v.upper()}"
            for v in NATIVE
            if v in q
        )
        if r["compile"]:
            out.append(
                f"{r['model']} {r['dtype']}, every block compiled (spmd.compile_blocks) in all: spmd step "
                f"{q['spmd']:.2f}x plain{native}."
            )
            continue
        text = (
            f"{r['model']} {r['dtype']}: spmd step {q['spmd']:.2f}x plain; "
            f"the recorder alone {q.get('plain+recorder', float('nan')):.2f}x; spmd under the recorder (what "
            f"launch.train runs) {q.get('spmd+recorder', float('nan')):.2f}x{native}."
        )
        if "profile_spmd" in r:
            p = r["profile_spmd"]
            dt = p["share"]["DTensor dispatch + sharding propagation"] + p["share"]["DTensor redistribute"]
            text += (
                f" In the profile, DTensor's Python (dispatch, sharding propagation, redistribute) is "
                f"{100 * dt:.0f}% of the spmd step and spmd's own hooks/moves "
                f"{100 * p['share']['spmd hooks, moves, constrain']:.0f}%; per step "
                f"{r['ops_spmd']['DTensor ops']:,} DTensor ops, "
                f"{p['calls_per_step']['redistribute calls']:,.0f} redistribute calls, "
                f"{p['calls_per_step']['parameter gathers (gather_param)']:,.0f} parameter gathers."
            )
        out.append(text)
    cost = rep.get("dtensor_op_overhead")
    if cost:
        out.append(
            "DTensor eager dispatch on a 1-process mesh costs "
            + ", ".join(
                f"{1e6 * v['overhead_s']:.0f} us per {k} ({v['dtensor_s'] / v['plain_s']:.1f}x the plain op)"
                for k, v in cost.items()
            )
            + "."
        )
        per_op = statistics.mean(v["overhead_s"] for v in cost.values())
        for r in rep["runs"]:
            if "ops_spmd" in r:
                est = r["ops_spmd"]["DTensor ops"] * per_op
                extra = r["step_s"]["spmd"] - r["step_s"]["plain"]
                out.append(
                    f"{r['model']} {r['dtype']}: {r['ops_spmd']['DTensor ops']:,} DTensor ops per step x "
                    f"{1e6 * per_op:.0f} us = {est:.3f} s of dispatch, against a measured spmd - plain "
                    f"difference of {extra:.3f} s per step."
                )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also measure torch.compile'd plain vs spmd")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (1: steadier on a shared machine)")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run each measurement in this many fresh processes, one after another, and pool their rounds",
    )
    ap.add_argument("--tag", default="", help="suffix of the results' name (a second shape on the same day)")
    ap.add_argument(
        "--per-block",
        action="store_true",
        help="also measure spmd's per-block path on the same mesh (what a rank of a mesh with data axes runs)",
    )
    ap.add_argument(
        "--native",
        action="store_true",
        help="also measure torch's DDP and fully_shard on the same 1-process group (the native reference)",
    )
    a = ap.parse_args(argv)
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rep = {"environment": common.environment(), "args": vars(a), "runs": []}
    extra = (["spmd-blocks"] if a.per_block else []) + (NATIVE if a.native else [])
    variants = ["plain", "plain+recorder", "spmd", "spmd+recorder"] + extra
    if DEVICE.type == "cpu":
        torch.set_num_threads(a.threads)
    rep["dtensor_op_overhead"] = dtensor_op_overhead()
    for model in a.models:
        for dtype in a.dtypes:
            for comp in [False, True] if a.compile else [False]:
                print(f"[overhead] {model} {dtype}{' compile' if comp else ''}", flush=True)
                try:
                    chosen = list(variants) if not comp else ["plain", "spmd"] + extra
                    r = measure_in_processes(a.processes, model, dtype, a.steps, a.warmup, chosen, comp, a.batch, a.seq)
                except Exception as e:  # noqa: BLE001  (compile of a DTensor model may fail: say so)
                    rep["runs"].append({"model": model, "dtype": dtype, "compile": comp, "error": str(e)[:500]})
                    print(f"[overhead]   failed: {str(e)[:200]}", flush=True)
                    continue
                rep["runs"].append(r)
                print("[overhead]   " + ", ".join(f"{v} {s:.4f}s" for v, s in r["step_s"].items()), flush=True)
    ok = [r for r in rep["runs"] if "error" not in r]
    rep["findings"] = findings({"runs": ok, "dtensor_op_overhead": rep["dtensor_op_overhead"]}) + [
        f"{r['model']} {r['dtype']} compile failed: {r['error'][:200]}" for r in rep["runs"] if "error" in r
    ]
    stem = common.RESULTS if a.out == str(common.RESULTS) else a.out
    from pathlib import Path

    name = f"{common.today()}-{common.device_slug()}-overhead" + (f"-{a.tag}" if a.tag else "")
    js, md = common.write(Path(stem) / name, rep, markdown({**rep, "runs": ok}))
    print(f"[overhead] wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
