"""Two trees of this repository, one benchmark, alternating: `python -m benchmarks.tree_ab --old REV`.

A change that should cost nothing (a refactor) is judged by the ratio of the same measurement on the tree
before and after it. Run one after the other, the two differ by whatever else the machine did meanwhile; so
this runs `benchmarks.mfu` on both trees in pairs of single rounds, the order alternating (old first, then
new first), and takes each pair's new / old tokens/s per spec: the median over the pairs with its
distribution-free interval (common.median_interval). `REV`'s tree is exported with `git archive` into a
temporary directory and run with its own code on the path; the current tree runs as it is on disk.

    python -m benchmarks.tree_ab --old a7ca789 --pairs 4 -- --model tiny --specs dp=4 fsdp=4 dp=2,fsdp=2 \
        fsdp=2,tp=2,sp tp=4 --no-native --no-single

Everything after `--` goes to `benchmarks.mfu` (both trees must accept it). Writes
benchmarks/results/<date>-<device>-tree-ab-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tree_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the revision to compare against (anything git rev-parse takes)")
    ap.add_argument(
        "--old-tree",
        default="",
        help="that revision's tree, already exported (a machine without the git history); --old is its full hash",
    )
    ap.add_argument("--pairs", type=int, default=4, help="pairs of single rounds, the order alternating")
    ap.add_argument("--tag", default="mfu", help="suffix of the results' name")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per benchmark run")
    ap.add_argument("mfu_args", nargs=argparse.REMAINDER, help="-- then benchmarks.mfu's arguments")
    a = ap.parse_args(argv)
    a.mfu_args = [x for x in a.mfu_args if x != "--"]
    if "--rounds" in a.mfu_args or "--out" in a.mfu_args:
        ap.error("--rounds and --out are set per run here; leave them out of benchmarks.mfu's arguments")
    return a


def _export(rev: str, into: Path) -> str:
    """`rev`'s tree under `into`; its full hash."""
    full = subprocess.run(["git", "-C", str(common.ROOT), "rev-parse", rev], capture_output=True, text=True)
    if full.returncode:
        raise SystemExit(f"tree_ab: {rev!r} is not a revision of this repository ({full.stderr.strip()})")
    archive = subprocess.run(["git", "-C", str(common.ROOT), "archive", full.stdout.strip()], capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return full.stdout.strip()


def _tokens_per_s(tree: Path, commit: str, mfu_args: list, out: Path, timeout: float) -> dict:
    """{spec: spmd tokens/s} of one round of benchmarks.mfu run from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree), SPMD_COMMIT=commit)
    cmd = [sys.executable, "-m", "benchmarks.mfu", *mfu_args, "--rounds", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    (report,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    for p in out.iterdir():
        p.unlink()
    return {row["spec"]: row["spmd"]["tokens_per_s"] for row in report["rows"]}


def _summary(old_commit: str, new_commit: dict, pairs: list) -> dict:
    specs = list(pairs[0]["new"])
    ratios = {s: common.median_interval([p["new"][s] / p["old"][s] for p in pairs]) for s in specs}
    return {"old": old_commit, "new": new_commit, "specs": specs, "pairs": pairs, "ratios": ratios}


def measure(a, env: dict) -> dict:
    """The pairs, each written out as it ends: a run stopped by a time limit keeps the pairs it finished."""
    new_commit = common.git_commit()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree, out = Path(a.old_tree or Path(tmp, "old")).resolve(), Path(tmp, "out")
        if a.old_tree:
            old_commit = a.old
        else:
            old_tree.mkdir()
            old_commit = _export(a.old, old_tree)
        trees = {"old": (old_tree, old_commit), "new": (common.ROOT, new_commit["commit"])}
        pairs = []
        for i in range(a.pairs):
            got = {}
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                print(f"[tree_ab] pair {i + 1}/{a.pairs}: {name}", file=sys.stderr, flush=True)
                got[name] = _tokens_per_s(*trees[name], a.mfu_args, out, a.timeout)
            pairs.append(got)
            m = _summary(old_commit, new_commit, pairs)
            common.write(_stem(a), {"environment": env, "args": vars(a), **m}, markdown(a, m, env))
    return m


def _stem(a) -> Path:
    return common.RESULTS / f"{common.today()}-{common.device_slug()}-tree-ab-{a.tag}"


def markdown(a, m: dict, env: dict) -> str:
    rows = []
    for s in m["specs"]:
        r = m["ratios"][s]
        old = sorted(p["old"][s] for p in m["pairs"])[len(m["pairs"]) // 2]
        new = sorted(p["new"][s] for p in m["pairs"])[len(m["pairs"]) // 2]
        rows.append([s, old, new, f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}] {r['verdict']}"])
    table = common.md_table(["spec", "old tokens/s", "new tokens/s", "new / old: median [interval]"], rows)
    return (
        f"# The same benchmark on two trees: new / old\n\n{env['device']}, {common.today()}, load average "
        f"{env.get('loadavg_1m', 0):.1f} at start. Old: {m['old']}; new: {m['new']['commit']}"
        f"{' (with uncommitted changes)' if m['new']['dirty'] else ''}. `benchmarks.mfu {' '.join(a.mfu_args)}`, "
        f"{len(m['pairs'])} pairs of one round each, the order alternating; a ratio is the median of the pairs' "
        f'ratios with its distribution-free interval, "even" where that covers 1.\n\n{table}\n'
    )


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    env = common.environment()
    m = measure(a, env)
    return common.publish(f"tree-ab-{a.tag}", {"environment": env, "args": vars(a), **m}, markdown(a, m, env))


if __name__ == "__main__":
    sys.exit(main())
