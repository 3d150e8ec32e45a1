"""How long `spmd.search` takes before and after a change, in the same conditions:
`python -m benchmarks.search_report --against REV --model 8b --world 8 --batch 16 --seq 8192 --specs ...`.

Each round runs the search once for the tree at REV (`git archive`d into a temporary folder) and once for this
tree, alternating, each in a fresh process with one planning process (workers=1), so that its CPU seconds are
the search's own. Besides wall and CPU seconds (the machine may be shared: CPU seconds and the number of explain
dry runs are what to compare), each run counts the explain dry runs it made (it wraps
spmd.analysis.explain.dry_run) and keeps its rows: the report says whether both trees give the same ranking
(every figure of every row, and every dropped spec with its reason).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common

# runs inside the tree being timed (which need not have this file): one search, its times, dry runs and rows
CHILD = """
import importlib, json, sys, time
import models, spmd
explain = importlib.import_module("spmd.analysis.explain")
count, dry_run = [0], explain.dry_run
def counted(*args, **kwargs):
    count[0] += 1
    return dry_run(*args, **kwargs)
explain.dry_run = counted
a = json.loads(sys.argv[1])
wall, cpu = time.perf_counter(), time.process_time()
rows = spmd.search(models.preset(a["model"]), a["world"], a["device"], batch_shape=tuple(a["batch_shape"]),
                   dtype=a["dtype"], specs=a["specs"], workers=1)
took = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "dry_runs": count[0]}
result = rows.to_dict()
with open(a["out"], "w") as f:
    json.dump({**took, "rows": {"ranked": result["ranked"], "dropped": result["dropped"]}}, f)
"""


def _tree_at(rev: str, into: str) -> str:
    """This repository's files at `rev`, unpacked under `into`."""
    archive = subprocess.run(["git", "-C", str(common.ROOT), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def _run(tree: str, args: dict, out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run([sys.executable, "-c", CHILD, json.dumps({**args, "out": out})], cwd=tree, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def _stats(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def compare(rev: str, args: dict, rounds: int) -> dict:
    """{"before": ..., "after": ...} of `rounds` interleaved runs each, and whether their rows agree."""
    runs: dict = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "before"))
        trees = {"before": _tree_at(rev, os.path.join(tmp, "before")), "after": str(common.ROOT)}
        for i in range(rounds):
            for which, tree in trees.items():
                runs[which].append(_run(tree, args, os.path.join(tmp, f"{which}-{i}.json")))
                print(f"round {i + 1} {which}: {runs[which][-1]['cpu_s']:.1f} CPU s", file=sys.stderr, flush=True)
    rows = [r.pop("rows") for side in runs.values() for r in side]
    summary = {side: {k: _stats(r, k) for k in ("cpu_s", "wall_s", "dry_runs")} for side, r in runs.items()}
    spread = max(_differs(r, rows[0]) for r in rows)
    return {**summary, "same_rows": spread <= ROUNDOFF, "rows_rel_diff": spread, "rows": rows[-1]}


ROUNDOFF = 1e-12  # a row's figures summed in another order (set order varies between processes) differ by ulps


def _differs(a, b) -> float:
    """The largest relative difference between two rows' numbers; inf where anything else differs."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) / max(abs(a), abs(b)) if a != b else 0.0
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return max((_differs(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return max((_differs(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a == b else float("inf")


def report(rev: str, args: dict, rounds: int, out: str) -> int:
    rev = subprocess.run(
        ["git", "-C", str(common.ROOT), "rev-parse", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    result = compare(rev, args, rounds)
    env = common.environment()
    b, a = result["before"], result["after"]
    lines = [
        "| | CPU s (median, min-max) | wall s (median) | explain dry runs |",
        "|---|---|---|---|",
        *(
            f"| {name} | {s['cpu_s']['median']:.1f} ({s['cpu_s']['min']:.1f}-{s['cpu_s']['max']:.1f}) | "
            f"{s['wall_s']['median']:.1f} | {s['dry_runs']['median']:.0f} |"
            for name, s in ((f"before ({rev[:12]})", b), (f"after ({env['commit'][:12]})", a))
        ),
    ]
    ratio = b["cpu_s"]["median"] / a["cpu_s"]["median"]
    markdown = (
        f"# spmd.search time before and after\n\n{args['model']} on {args['world']} x {args['device']}, batch "
        f"{tuple(args['batch_shape'])}, {args['dtype']}, specs {args['specs'] or 'all'}; {rounds} interleaved "
        f"rounds, one process each (workers=1), load average {env.get('loadavg_1m', 0):.1f} at the end.\n\n"
        + "\n".join(lines)
        + f"\n\nCPU time {ratio:.2f}x less; same rows before and after: **{result['same_rows']}** (largest relative "
        f"difference of a figure {result['rows_rel_diff']:.1e}; summation order varies between processes).\n"
    )
    subset = f"-{len(args['specs'])}-specs" if args["specs"] else ""
    stem = Path(out) / f"{common.today()}-search-speed-{args['model']}-{args['world']}x{args['device']}{subset}"
    js, md = common.write(stem, {"environment": env, "against": rev, "args": args, **result}, markdown)
    print(markdown, f"wrote {js} and {md}", sep="\n")
    return 0
