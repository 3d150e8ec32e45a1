"""Shared bits of the benchmarks: where results go, what the device is called, the run's environment,
torchrun command lines and reading the trainer's JSONL."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from launch.metrics import cpu_name

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu {cpu_name()}"


def device_slug() -> str:
    """`h100`, `h200`, `a100`, ... on GPUs; `cpu-<vendor>-<family>` on CPUs (as benchmarks/kernels.py names it)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for known in ("h200", "h100", "a100", "l40s", "a10g", "l4"):
            if known in name:
                return known
        return re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    words = re.sub(r"[^a-z0-9 ]+", " ", cpu_name().lower()).split()
    return "cpu-" + "-".join(words[:2]) if words else "cpu"


def today() -> str:
    return datetime.date.today().isoformat()


def git_commit() -> dict:
    """The commit the results were made at, and whether the code differed from it (results files aside).
    A copy of a committed tree whose git directory is missing or not its own (a device machine's) names its
    commit in `SPMD_COMMIT`."""
    if os.environ.get("SPMD_COMMIT"):
        named = os.environ["SPMD_COMMIT"]
        if not re.fullmatch(r"[0-9a-f]{40}", named):  # results name the commit in full (tests/test_results.py)
            raise ValueError(
                f"SPMD_COMMIT={named!r}: give the commit's full 40-character hash (git rev-parse {named or 'HEAD'})"
            )
        return {"commit": named, "dirty": False}

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"))
    except OSError:  # no git on this machine
        commit, dirty = "", False
    return {"commit": commit or "unknown", "dirty": dirty}


def environment() -> dict:
    """What a reader needs to weigh timings: the machine, its load, the software and its commit."""
    env = {
        "device": device_name(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "date": today(),
        **git_commit(),
    }
    try:
        env["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    if torch.cuda.is_available():
        env["gpus"] = torch.cuda.device_count()
    return env


def torchrun(nproc: int) -> list[str]:
    exe = shutil.which("torchrun")
    base = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return base + ["--standalone", f"--nproc-per-node={nproc}"]


def run(
    cmd: list[str], timeout: float = 1800, env: dict | None = None, retries: int = 1
) -> subprocess.CompletedProcess:
    """Runs a command from the repository root; a failed run is retried `retries` times (a shared machine
    occasionally kills a gloo process group), then raises with the output's tail."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    for attempt in range(retries + 1):
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return proc
        print(f"[benchmarks] attempt {attempt + 1} failed ({proc.returncode}): {' '.join(cmd[-12:])}", file=sys.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def steady(rows: list[dict], warmup: int) -> dict:
    """Summary of the rows after `warmup` steps: medians of step time, tokens/s, MFU; max peak memory."""
    kept = rows[warmup:] or rows[-1:]
    med = lambda k: statistics.median(r[k] for r in kept)  # noqa: E731
    return {
        "steps": len(kept),
        "step_time_s": med("step_time_s"),
        "tokens_per_s": med("tokens_per_s"),
        "mfu": med("mfu"),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in kept),
        "comm_bytes": med("comm_bytes"),
        "final_loss": kept[-1]["loss"],
        "step_time_spread": (max(r["step_time_s"] for r in kept) - min(r["step_time_s"] for r in kept))
        / max(med("step_time_s"), 1e-12),
    }


def portable(text: str) -> str:
    """`text` with this checkout's and this user's paths made relative: results name no machine's paths."""
    return text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".").replace(str(Path.home()), "~")


def write(stem: Path, report: dict, markdown: str) -> tuple[Path, Path]:
    """Writes `stem`.json and `stem`.md; the report must carry `environment()` (device, load, commit)."""
    if "commit" not in report.get("environment", {}):
        raise ValueError("a results report needs its 'environment' (benchmarks.common.environment())")
    stem.parent.mkdir(parents=True, exist_ok=True)
    js, md = stem.with_suffix(".json"), stem.with_suffix(".md")
    js.write_text(portable(json.dumps(report, indent=1, default=str)) + "\n")
    md.write_text(portable(markdown.rstrip()) + "\n")
    return js, md


def publish(name: str, report: dict, markdown: str) -> int:
    """Writes results/<date>-<device>-`name`.{json,md}, prints their paths and the markdown; 0, a main's exit code."""
    for path in write(RESULTS / f"{today()}-{device_slug()}-{name}", report, markdown):
        print(path)
    print(markdown)
    return 0


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def trainer_flags() -> set[str]:
    """The flags launch.train accepts, so a benchmark passes --compile and friends only where they exist."""
    try:
        from launch.config import parser

        return {s for a in parser()._actions for s in a.option_strings}
    except Exception:  # noqa: BLE001  (a trainer mid-edit must not break the benchmark's own flags)
        return set()


def median_interval(ratios: list[float], level: float = 0.95) -> dict:
    """The median of per-round ratios and a distribution-free confidence interval for it: the order statistics
    x(k) and x(n+1-k) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least `level`
    (the range when too few rounds reach it). "even" when the interval covers 1.0: no ordering is shown then."""
    xs = sorted(ratios)
    n = len(xs)
    k, below = 1, 1 / 2**n  # below: P(Binomial(n, 1/2) < k)
    while k < (n + 1) // 2:
        nxt = below + math.comb(n, k) / 2**n
        if 1 - 2 * nxt < level:
            break
        k, below = k + 1, nxt
    lo, hi = xs[k - 1], xs[n - k]
    verdict = "even" if lo <= 1.0 <= hi else ("above 1" if lo > 1.0 else "below 1")
    return {
        "median": statistics.median(xs),
        "low": lo,
        "high": hi,
        "coverage": 1 - 2 * below,
        "rounds": n,
        "verdict": verdict,
    }
