"""Where a full `spmd.search` spends its time, dry run by dry run:
`python -m benchmarks.search_dry_runs --log LOG -- --model 8b --world 8 --device h100 --batch 16 --seq 8192`.

Runs `python -m spmd.search` with the given flags in this process (add `--workers 1` to count every dry run
here), logging each explain dry run as one JSON line of LOG as it ends: [mesh sizes, batch shape, checkpointing,
micro-batches, ZeRO stage, sequence parallel, blocks of the copy, CPU s]. `--report LOG` (also run after the
search, or on a log a stopped search left) writes results/<date>-search-dry-runs-<name>.{json,md}: the dry runs,
their CPU seconds per mesh, the commit and the load average.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from pathlib import Path

from benchmarks import common


def logged_search(log_path: str, argv: list[str]) -> int:
    explain = importlib.import_module("spmd.analysis.explain")
    dry_run = explain.dry_run

    def logged(*args, **kwargs):
        start = time.process_time()
        try:
            return dry_run(*args, **kwargs)
        finally:
            a = inspect.signature(dry_run).bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            blocks = sum(1 for n, _ in a["model"].named_modules() if n.count(".") == 1 and n.startswith("layers."))
            entry = [dict(a["sizes"]), list(a["batch_shape"]), a["ac"], a["grad_accum"], a["rules"].zero_stage]
            entry += [a["rules"].sequence_parallel, blocks, round(time.process_time() - start, 3)]
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    explain.dry_run = logged
    from spmd.search_command import search_main

    return search_main(argv)


def report(log_path: str, name: str, out: str, finished: bool, tree: str = "") -> int:
    """The results file of a dry-run log; `tree`: the commit the log's search ran at (default this one)."""
    runs = [json.loads(line) for line in open(log_path) if line.strip()]
    by_mesh: dict = {}
    for sizes, _, _, _, _, sp, _, cpu in runs:
        mesh = ",".join(f"{a}={n}" for a, n in sizes.items()) + (",sp" if sp else "")
        by_mesh.setdefault(mesh, []).append(cpu)
    env = common.environment()
    tree = tree or env["commit"]
    rows = [[mesh, len(c), f"{sum(c):.1f}", f"{max(c):.1f}"] for mesh, c in sorted(by_mesh.items())]
    total = sum(r[-1] for r in runs)
    markdown = (
        f"# spmd.search dry runs: {name}\n\n{len(runs)} explain dry runs, {total:.1f} CPU s in them; the search "
        f"{'finished' if finished else 'was stopped before it finished'}. Searched at {tree[:12]}, load "
        f"average {env.get('loadavg_1m', 0):.1f} when written.\n\n"
        + common.md_table(["mesh", "dry runs", "CPU s", "dearest CPU s"], rows)
        + "\n"
    )
    stem = Path(out) / f"{common.today()}-search-dry-runs-{name}"
    report_data = {"environment": env, "tree": tree, "finished": finished, "dry_runs": runs}
    js, md = common.write(stem, report_data, markdown)
    print(markdown, f"wrote {js} and {md}", sep="\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", required=True, help="JSON lines, one per dry run (appended)")
    ap.add_argument("--name", default="", help="results file name; with no search flags, report LOG only")
    ap.add_argument("--stopped", action="store_true", help="with no search flags: the search did not finish")
    ap.add_argument("--tree", default="", help="with no search flags: the commit LOG's search ran at")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("search", nargs=argparse.REMAINDER, help="-- then spmd.search's flags")
    a = ap.parse_args(argv)
    flags = [f for f in a.search if f != "--"]
    if flags:
        rc = logged_search(a.log, flags)
        if rc != 0:
            return rc
    return report(a.log, a.name or "search", a.out, bool(flags) or not a.stopped, a.tree)


if __name__ == "__main__":
    sys.exit(main())
