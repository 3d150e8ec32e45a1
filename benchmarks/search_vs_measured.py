"""Does `spmd.search` rank specs the way this machine does? Predict, run, compare ranks.

    python -m benchmarks.search_vs_measured [--models tiny small] [--nproc 4] [--top 3] [--bottom 3] [--steps 8]

1. Describe this machine as a `spmd.analysis.devices.Device`: peak = its best single-thread fp32 GEMM FLOP/s (torchrun
   gives each process one thread; with more processes than cores each gets its share), links = gloo on
   loopback with a latency, a latency per ring step and a bandwidth fitted to all-reduces and all-gathers
   timed on `nproc` processes, over the whole group and over groups of half its size down to 2, which run
   side by side as a mesh axis' groups do (t = latency + steps x step latency + ring bytes / bandwidth,
   least squares; steps and bytes as spmd.analysis.record counts them).
2. `spmd.search(model, nproc, device=that)` ranks every spec.
3. The `top` best and `bottom` worst predicted specs train for `steps` steps with launch.train (torchrun);
   the median step time after `warmup` steps is the measurement.
4. Spearman's rank correlation between predicted and measured step times (also for two naive predictors:
   bytes moved, and number of collectives). The ranking is worth publishing only where the correlation holds.
Writes benchmarks/results/<date>-<device>-search-vs-measured.{json,md}. `--reuse RESULTS.json` measures nothing:
it ranks the specs of a committed report again with today's search (same device figures) and prints the
correlations with that report's measurements, the planner's and the collective count's (writes no file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import common


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho with average ranks for ties (Pearson correlation of the ranks)."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


# ------------------------------------------------------------------------------------ gloo link, measured
def gloo_worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    from spmd.analysis.record import wire_bytes

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    groups, n = [(None, world)], world
    while n % 2 == 0 and n > 2:
        n //= 2
        groups.append((dist.new_subgroups(n)[0], n))
    rows = []
    for group, n in groups:
        for kind in ("all_reduce", "all_gather"):
            for numel in (256, 4096, 65536, 262144, 1048576):
                x = torch.ones(numel)
                buf = torch.empty(numel * n)
                samples = []
                for _i in range(12):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if kind == "all_reduce":
                        dist.all_reduce(x, group=group)
                    else:
                        dist.all_gather_into_tensor(buf, x, group=group)
                    samples.append(time.perf_counter() - t0)
                full = numel * 4 * (n if kind == "all_gather" else 1)
                rows.append(
                    {
                        "kind": kind,
                        "ranks": n,
                        "full_bytes": full,
                        "wire_bytes": wire_bytes(kind, full, n),
                        "seconds": statistics.median(samples[2:]),
                    }
                )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def fit_link(rows: list[dict], nproc: int) -> dict:
    """{latency_s, step_latency_s, bandwidth_Bps} minimising the squared error of t = latency + steps x
    step latency + wire / bandwidth, none negative. A sample without `ranks` (reports before the per-step
    term) was timed over all `nproc` processes."""
    import torch

    from spmd.analysis.record import ring_steps

    steps = [ring_steps(r["kind"], r.get("ranks", nproc)) for r in rows]
    x = torch.tensor([[1.0, s, r["wire_bytes"]] for s, r in zip(steps, rows)], dtype=torch.float64)
    t = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1e-30)
    terms = [0, 1, 2]
    while True:  # drop a term that fits negative and refit the others
        coef = torch.linalg.lstsq(x[:, terms] / scale[terms], t[:, None]).solution[:, 0] / scale[terms]
        if all(c >= 0 for c in coef) or len(terms) == 1:
            break
        terms.pop(int(torch.argmin(coef)))
    fit = dict.fromkeys(range(3), 0.0) | {i: max(float(c), 0.0) for i, c in zip(terms, coef)}
    return {"latency_s": fit[0], "step_latency_s": fit[1], "bandwidth_Bps": 1.0 / max(fit[2], 1e-15)}


def measure_link(nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "gloo.json")
        common.run(common.torchrun(nproc) + ["-m", "benchmarks.search_vs_measured", "--gloo-worker", str(out)])
        rows = json.loads(out.read_text())
    return {**fit_link(rows, nproc), "samples": rows}


# ------------------------------------------------------------------------------------ runs
def run_spec(model: str, spec: str, nproc: int, batch: int, seq: int, steps: int, warmup: int) -> dict:
    sizes = ",".join(p for p in spec.split(",") if p != "sp")
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp, "m.jsonl")
        cmd = (
            common.torchrun(nproc)
            + [
                "-m",
                "launch.train",
                "--model",
                model,
                "--mesh",
                sizes,
                "--steps",
                str(steps),
                "--batch-size",
                str(batch),
                "--seq-len",
                str(seq),
                "--dtype",
                "fp32",
                "--metrics",
                str(jsonl),
            ]
            + (["--sp"] if spec.endswith(",sp") else [])
        )
        common.run(cmd)
        return common.steady(common.read_jsonl(jsonl), warmup)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gloo-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--bottom", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="runs per spec (alternating order); median kept")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--reuse", default="", help="a committed search-vs-measured JSON: re-rank, measure nothing")
    a = ap.parse_args(argv)
    if a.gloo_worker:
        gloo_worker(a.gloo_worker)
        return 0
    if a.reuse:
        return rerank(json.loads(Path(a.reuse).read_text()))
    import torch

    import spmd
    from models.llama import LlamaConfig
    from spmd.analysis.devices import cpu_device, measure_gemm_flops

    rep = {"environment": common.environment(), "args": vars(a), "models": []}
    per_thread = measure_gemm_flops(torch.float32, threads=1, budget_s=0.6, sizes=(256, 512, 1024))
    link = measure_link(a.nproc)
    dev = cpu_device(
        a.nproc,
        1,
        per_thread,
        bandwidth=link["bandwidth_Bps"],
        latency=link["latency_s"],
        step_latency=link["step_latency_s"],
    )
    rep["device"] = {"peak_per_thread": per_thread, "peak_per_rank": dev.peak("fp32"), **link}
    print(f"[search_vs_measured] GEMM {per_thread / 1e9:.1f} GFLOP/s per thread; gloo {_link_words(link)}", flush=True)
    for model in a.models:
        cfg = LlamaConfig.preset(model)
        rows = spmd.search(
            cfg, a.nproc, device=dev, batch_shape=(a.batch, a.seq), dtype="fp32", ac="none", grad_accum=1, zero=3
        )  # as run_spec trains
        chosen = list(rows[: a.top]) + [r for r in rows[max(a.top, len(rows) - a.bottom) :]]
        print(
            f"[search_vs_measured] {model}: {len(rows)} specs ranked; running {', '.join(r.spec for r in chosen)}",
            flush=True,
        )
        measured = {r.spec: [] for r in chosen}
        for i in range(a.repeats):
            for r in chosen if i % 2 == 0 else chosen[::-1]:
                measured[r.spec].append(run_spec(model, r.spec, a.nproc, a.batch, a.seq, a.steps, a.warmup))
                print(
                    f"  {r.spec:<18} predicted {r.step_s:.4f}s measured {measured[r.spec][-1]['step_time_s']:.4f}s",
                    flush=True,
                )
        out_rows = []
        for r in chosen:
            m = statistics.median(x["step_time_s"] for x in measured[r.spec])
            out_rows.append(
                {
                    "spec": r.spec,
                    "predicted_rank": rows.index(r) + 1,
                    "predicted_s": r.step_s,
                    "compute_s": r.compute_s,
                    "activation_comm_s": r.activation_comm_s,
                    "param_comm_s": r.param_comm_s,
                    "comm_bytes": r.comm_bytes,
                    "collectives": r.collectives,
                    "measured_s": m,
                    "measured_runs": [x["step_time_s"] for x in measured[r.spec]],
                    "spread": max(x["step_time_spread"] for x in measured[r.spec]),
                }
            )
        pred = [x["predicted_s"] for x in out_rows]
        meas = [x["measured_s"] for x in out_rows]
        order = sorted(range(len(meas)), key=lambda i: meas[i])
        for rank, i in enumerate(order, 1):
            out_rows[i]["measured_rank_among_run"] = rank
        entry = {
            "model": model,
            "ranked": len(rows),
            "rows": out_rows,
            "spearman_predicted": spearman(pred, meas),
            "spearman_comm_bytes": spearman([x["comm_bytes"] for x in out_rows], meas),
            "spearman_collectives": spearman([x["collectives"] for x in out_rows], meas),
            "all_predictions": [{"spec": r.spec, "step_s": r.step_s} for r in rows],
        }
        rep["models"].append(entry)
        print(
            f"[search_vs_measured] {model}: Spearman predicted vs measured {entry['spearman_predicted']:.3f}",
            flush=True,
        )
    stem = Path(a.out) / f"{common.today()}-{common.device_slug()}-search-vs-measured"
    js, md = common.write(stem, rep, markdown(rep))
    print(f"[search_vs_measured] wrote {js} and {md}")
    return 0


def rerank(rep: dict) -> int:
    """Prints, per model of a committed report, Spearman's rho of today's predictions and of the collective
    count (today's plans) against the report's measured step times, over every spec it measured."""
    import spmd
    from models.llama import LlamaConfig
    from spmd.analysis.devices import cpu_device

    args, d = rep["args"], rep["device"]
    link = fit_link(d["samples"], args["nproc"])
    dev = cpu_device(
        args["nproc"],
        1,
        d["peak_per_thread"],
        bandwidth=link["bandwidth_Bps"],
        latency=link["latency_s"],
        step_latency=link["step_latency_s"],
    )
    print(
        f"re-ranked {rep['environment']['commit'][:12]}'s measurements with today's spmd.search; gloo refitted "
        f"to the report's samples: {_link_words(link)}"
    )
    for m in rep["models"]:
        rows = {
            r.spec: r
            for r in spmd.search(
                LlamaConfig.preset(m["model"]),
                args["nproc"],
                device=dev,
                dtype="fp32",
                batch_shape=(args["batch"], args["seq"]),
                ac="none",
                grad_accum=1,
                zero=3,
            )
        }
        measured = [x["measured_s"] for x in m["rows"]]
        ours = spearman([rows[x["spec"]].step_s for x in m["rows"]], measured)
        count = spearman([rows[x["spec"]].collectives for x in m["rows"]], measured)
        print(
            f"{m['model']}: over {len(measured)} measured specs, Spearman rho predicted {ours:.3f} (report's "
            f"{m['spearman_predicted']:.3f}), collective count {count:.3f}: the planner {_verdict(ours, count)} it"
        )
    return 0


def _link_words(link: dict) -> str:
    return (
        f"fitted latency {1e6 * link['latency_s']:.0f} us + {1e6 * link['step_latency_s']:.0f} us "
        f"per ring step, bandwidth {link['bandwidth_Bps'] / 1e9:.2f} GB/s"
    )


def _group_sizes(d: dict) -> str:
    return " and ".join(str(n) for n in sorted({r["ranks"] for r in d["samples"]}, reverse=True))


def _verdict(planner: float, trivial: float) -> str:
    return "beats" if planner > trivial else "ties" if planner == trivial else "does not beat"


def markdown(rep: dict) -> str:
    env, d, a = rep["environment"], rep["device"], rep["args"]
    lines = [
        "# spmd.search: predicted vs measured step times",
        "",
        f"{env['date']}, {env['device']}, torch {env['torch']}, {env['cpu_count']} cores, load average "
        f"{env.get('loadavg_1m', float('nan')):.1f} at start; {a['nproc']} processes (1 thread each), batch "
        f"{a['batch']} x {a['seq']}, fp32, {a['steps']} steps, median after {a['warmup']}.",
        "",
        f"Device model: GEMM peak {d['peak_per_thread'] / 1e9:.1f} GFLOP/s per thread "
        f"({d['peak_per_rank'] / 1e9:.1f} per rank with {a['nproc']} processes on {env['cpu_count']} cores); "
        f"gloo {_link_words(d)} (collectives over {_group_sizes(d)} ranks).",
        "",
    ]
    for m in rep["models"]:
        lines += [
            f"## {m['model']}: Spearman rho (predicted, measured) = {m['spearman_predicted']:.3f} "
            f"over {len(m['rows'])} specs",
            "",
            f"Naive predictors on the same runs: bytes moved rho = {m['spearman_comm_bytes']:.3f}, "
            f"number of collectives rho = {m['spearman_collectives']:.3f}: the planner "
            f"{_verdict(m['spearman_predicted'], m['spearman_collectives'])} the collective count.",
            "",
            f"| spec | predicted rank (of {m['ranked']}) | measured rank (of run) | predicted s | compute s | "
            "act comm s | param comm s | collectives | comm bytes | measured s | measured / predicted |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            lines.append(
                f"| {r['spec']} | {r['predicted_rank']} | {r['measured_rank_among_run']} | "
                f"{r['predicted_s']:.4f} | {r['compute_s']:.4f} | {r['activation_comm_s']:.4f} | "
                f"{r['param_comm_s']:.4f} | {r['collectives']} | {r['comm_bytes']:,} | {r['measured_s']:.4f} | "
                f"{r['measured_s'] / r['predicted_s']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    from spmd.layout.mesh import exit_process

    exit_process(main())  # not sys.exit: see exit_process
