"""Does `spmd.search` rank specs the way this machine does? Measure every spec, fit, predict, compare ranks.

    python -m benchmarks.search_vs_measured [--models tiny small] [--nproc 4] [--rounds 5] [--steps 8] [--warmup 3]

1. Every spec `spmd.search` ranks for each model is measured in `rounds` interleaved rounds: one torchrun launch
   per round (benchmarks.spec_steps) runs every spec of every model in turn, in alternating order from round to
   round; per spec and round, the median of `steps` step times after `warmup`, then one step with every
   collective timed from issue to completion (spmd.analysis.timed). The measurement of a spec is the median
   over rounds, its spread (max - min) / median over rounds.
2. This machine as a `Device` per spec (benchmarks.step_fit): compute at the FLOP/s of its model's own linear
   layers' matmuls at a rank's share of the batch on one thread (torchrun gives each process one; with more
   processes than cores each gets its share), links fitted per collective kind to the collectives timed
   inside the steps of every other spec, of every model (held out: none of the spec's own runs).
3. `spmd.search(model, nproc, device=that, specs=[spec])` predicts each spec; Spearman's rank correlation
   between predicted and measured step times, next to two trivial predictors (the number of collectives, bytes
   moved), and whether the measured best spec is among the planner's first two.
Writes benchmarks/results/<date>-<device>-search-vs-measured.{json,md}. `--reuse RESULTS.json` measures nothing:
it ranks the specs of a committed report again with today's search (its device figures refitted from its own
samples) and prints the correlations with that report's measurements, the planner's and the collective count's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.step_fit import device_for, fit_link, fitted_devices, link_words

__all__ = ["spearman", "fit_link", "main"]


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


# ------------------------------------------------------------------------------------ measuring
def measure_round(jobs: list[tuple[str, str]], a, i: int) -> list[dict]:
    """One round: every (model, spec) of `jobs` in one torchrun launch (benchmarks.spec_steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "round.json")
        flags = ["--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)]
        cmd = common.torchrun(a.nproc) + ["-m", "benchmarks.spec_steps", str(out), *flags, "--job"]
        common.run(cmd + [f"{m}:{s}" for m, s in jobs], timeout=3600)
        got = json.loads(out.read_text())["jobs"]
    for j in got:
        j["round"] = i
        print(f"  round {i + 1}: {j['model']} {j['spec']:<16} {statistics.median(j['step_times']):.4f} s", flush=True)
    return got


def predicted_rows(model: str, a, d: dict) -> list:
    """The search's row of each spec of `model`, each predicted on the device fitted to the collectives of the
    other specs (`d["per_spec"]`, step_fit.held_out), fastest first."""
    rows = []
    for spec, fits in d["per_spec"].items():
        dev = device_for(a.nproc, d["peak_per_thread"], fits)
        rows += _search(model, a, dev, [spec])
    return sorted(rows, key=lambda r: r.step_s)


def _search(model: str, a, dev, specs=None):
    import spmd
    from models.llama import LlamaConfig

    cfg = LlamaConfig.preset(model)  # as benchmarks.spec_steps trains: fp32, ZeRO 3, no checkpointing, 1 pass
    return spmd.search(
        cfg,
        a.nproc,
        device=dev,
        batch_shape=(a.batch, a.seq),
        dtype="fp32",
        ac="none",
        grad_accum=1,
        zero=3,
        specs=specs,
    )


PACKED = ("kind", "ranks", "wire_bytes", "seconds")  # a timed collective in a report: a row of these


def packed(jobs: list[dict]) -> list[dict]:
    """`jobs` as a report keeps them: times to the microsecond, each timed collective a row of PACKED."""
    return [
        j
        | {"step_times": [round(t, 6) for t in j["step_times"]]}
        | {"collectives": [[c[k] if k != "seconds" else round(c[k], 6) for k in PACKED] for c in j["collectives"]]}
        for j in jobs
    ]


def unpacked(jobs: list[dict]) -> list[dict]:
    return [j | {"collectives": [dict(zip(PACKED, c)) for c in j["collectives"]]} for j in jobs]


# ------------------------------------------------------------------------------------ comparing
def compare(model: str, rows, jobs: list[dict]) -> dict:
    """The report's entry for `model`: per ranked spec its prediction and measurements over the rounds, the
    rank correlations, and whether the measured best spec is in the planner's first two."""
    out_rows = []
    for rank, r in enumerate(rows, 1):
        mine = [j for j in jobs if j["model"] == model and j["spec"] == r.spec]
        per_round = [statistics.median(j["step_times"]) for j in mine]
        comm = [sum(c["seconds"] for c in j["collectives"]) for j in mine]
        m = statistics.median(per_round)
        out_rows.append(
            {
                "spec": r.spec,
                "predicted_rank": rank,
                "predicted_s": r.step_s,
                "compute_s": r.compute_s,
                "activation_comm_s": r.activation_comm_s,
                "param_comm_s": r.param_comm_s,
                "comm_bytes": r.comm_bytes,
                "collectives": r.collectives,
                "measured_s": m,
                "measured_rounds": per_round,
                "spread": (max(per_round) - min(per_round)) / m,
                "timed_comm_s": statistics.median(comm),
            }
        )
    meas = [x["measured_s"] for x in out_rows]
    for rank, i in enumerate(sorted(range(len(meas)), key=lambda i: meas[i]), 1):
        out_rows[i]["measured_rank"] = rank
    best = min(out_rows, key=lambda x: x["measured_s"])
    return {
        "model": model,
        "ranked": len(rows),
        "rows": out_rows,
        "spearman_predicted": spearman([x["predicted_s"] for x in out_rows], meas),
        "spearman_comm_bytes": spearman([x["comm_bytes"] for x in out_rows], meas),
        "spearman_collectives": spearman([x["collectives"] for x in out_rows], meas),
        # not a predictor (measured): how far collective time alone, as timed in the steps, ranks them
        "spearman_timed_comm": spearman([x["timed_comm_s"] for x in out_rows], meas),
        "measured_best": best["spec"],
        "measured_best_in_top_2": best["predicted_rank"] <= 2,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds, every spec once each")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--reuse", default="", help="a committed search-vs-measured JSON: re-rank, measure nothing")
    a = ap.parse_args(argv)
    if a.reuse:
        return rerank(json.loads(Path(a.reuse).read_text()))
    from spmd.analysis.devices import cpu_device

    rep = {"environment": common.environment(), "args": vars(a), "models": []}
    placeholder = cpu_device(a.nproc, 1, 1e9)  # which specs lay out and fit does not depend on the figures
    specs = {m: [r.spec for r in _search(m, a, placeholder)] for m in a.models}
    jobs = [(m, s) for m in a.models for s in specs[m]]
    print(f"[search_vs_measured] {len(jobs)} specs x {a.rounds} rounds, one launch per round", flush=True)
    measured = [j for i in range(a.rounds) for j in measure_round(jobs if i % 2 == 0 else jobs[::-1], a, i)]
    rep["measured"] = packed(measured)
    rep["device"] = fitted_devices(a, measured, specs)
    for m in a.models:
        entry = compare(m, predicted_rows(m, a, rep["device"][m]), measured)
        rep["models"].append(entry)
        print(
            f"[search_vs_measured] {m}: Spearman planner {entry['spearman_predicted']:.3f}, collective count "
            f"{entry['spearman_collectives']:.3f}; measured best {entry['measured_best']} in the planner's top 2: "
            f"{entry['measured_best_in_top_2']}",
            flush=True,
        )
    stem = Path(a.out) / f"{common.today()}-{common.device_slug()}-search-vs-measured"
    js, md = common.write(stem, rep, markdown(rep))
    print(f"[search_vs_measured] wrote {js} and {md}")
    return 0


def rerank(rep: dict) -> int:
    """Prints, per model of a committed report, Spearman's rho of today's predictions and of the collective
    count (today's plans) against the report's measured step times, over every spec it measured. The device
    is refitted to the report's own samples: per kind to the collectives timed in its steps (each spec's from
    the other specs', step_fit.held_out), or, for a report of isolated collectives, one link."""
    from types import SimpleNamespace

    args, d = rep["args"], rep["device"]
    a = SimpleNamespace(**args)
    if "samples" in d:  # before the in-step fit: one link, one GEMM peak
        from spmd.analysis.devices import cpu_device

        link = fit_link(d["samples"], args["nproc"])
        dev = cpu_device(
            args["nproc"], 1, d["peak_per_thread"], link["bandwidth_Bps"], link["latency_s"], link["step_latency_s"]
        )
        devices = dict.fromkeys((m["model"] for m in rep["models"]), dev)
        print(f"re-ranking {rep['environment']['commit'][:12]}'s measurements; gloo refitted: {link_words(link)}")
    else:
        a.models = [m["model"] for m in rep["models"]]
        specs = {m["model"]: [r["spec"] for r in m["rows"]] for m in rep["models"]}
        fits = fitted_devices(a, unpacked(rep["measured"]), specs)
        devices = None
    for m in rep["models"]:
        ranked = (
            _search(m["model"], a, devices[m["model"]]) if devices else predicted_rows(m["model"], a, fits[m["model"]])
        )
        rows = {r.spec: r for r in ranked}
        measured = [x["measured_s"] for x in m["rows"]]
        ours = spearman([rows[x["spec"]].step_s for x in m["rows"]], measured)
        count = spearman([rows[x["spec"]].collectives for x in m["rows"]], measured)
        print(
            f"{m['model']}: over {len(measured)} measured specs, Spearman rho predicted {ours:.3f} (report's "
            f"{m['spearman_predicted']:.3f}), collective count {count:.3f}: the planner {_verdict(ours, count)} it"
        )
    return 0


def _verdict(planner: float, trivial: float) -> str:
    return "beats" if planner > trivial else "ties" if planner == trivial else "does not beat"


def markdown(rep: dict) -> str:
    env, a = rep["environment"], rep["args"]
    lines = [
        "# spmd.search: predicted vs measured step times",
        "",
        f"{env['date']}, {env['device']}, torch {env['torch']}, {env['cpu_count']} cores, load average "
        f"{env.get('loadavg_1m', float('nan')):.1f} at start, commit {env['commit'][:12]}; {a['nproc']} "
        f"processes (1 thread each), batch {a['batch']} x {a['seq']}, fp32, ZeRO 3; {a['rounds']} interleaved "
        f"rounds, each the median of {a['steps']} steps after {a['warmup']}; a spec's figure is the median over "
        "rounds, its spread (max - min) / median.",
        "",
    ]
    for m in rep["models"]:
        d = rep["device"][m["model"]]
        lines += [
            f"## {m['model']}: Spearman rho (predicted, measured) = {m['spearman_predicted']:.3f} over "
            f"{len(m['rows'])} specs",
            "",
            f"Trivial predictors on the same runs: number of collectives rho = {m['spearman_collectives']:.3f}, "
            f"bytes moved rho = {m['spearman_comm_bytes']:.3f}: the planner "
            f"{_verdict(m['spearman_predicted'], m['spearman_collectives'])} the collective count. Measured best: "
            f"{m['measured_best']}, {'within' if m['measured_best_in_top_2'] else 'not within'} the planner's top 2. "
            f"The collectives' own times in the timed step rank the specs at rho = {m['spearman_timed_comm']:.3f} "
            "(measured, not predicted: how far collective time alone ranks them).",
            "",
            f"Device: linear layers' matmuls at {d['peak_per_thread'] / 1e9:.1f} GFLOP/s per thread; each spec's "
            "links fitted to the collectives timed in the steps of the other specs, of every model (leave one spec "
            "out); the fit of every sample, for reference:",
            "",
            "| kind | samples | latency us | per ring step us | bandwidth GB/s | rms error / mean |",
            "|---|---|---|---|---|---|",
        ]
        for k, f in d["fits"].items():
            lines.append(
                f"| {k} | {f['samples']} | {1e6 * f['latency_s']:.0f} | {1e6 * f['step_latency_s']:.0f} | "
                f"{f['bandwidth_Bps'] / 1e9:.2f} | {f['rel_rms']:.2f} |"
            )
        lines += ["", _table(m), ""]
    return "\n".join(lines)


def _table(m: dict) -> str:
    head = [
        f"| spec | predicted rank (of {m['ranked']}) | measured rank | predicted s | compute s | act comm s | "
        "param comm s | timed comm s | measured - timed comm s | collectives | comm bytes | measured s | spread | "
        "measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(
        head
        + [
            f"| {r['spec']} | {r['predicted_rank']} | {r['measured_rank']} | {r['predicted_s']:.4f} | "
            f"{r['compute_s']:.4f} | {r['activation_comm_s']:.4f} | {r['param_comm_s']:.4f} | "
            f"{r['timed_comm_s']:.4f} | {r['measured_s'] - r['timed_comm_s']:.4f} | {r['collectives']} | "
            f"{r['comm_bytes']:,} | {r['measured_s']:.4f} | "
            f"{r['spread']:.2f} | {r['measured_s'] / r['predicted_s']:.2f} |"
            for r in m["rows"]
        ]
    )


if __name__ == "__main__":
    from spmd.layout.mesh import exit_process

    exit_process(main())  # not sys.exit: see exit_process
