"""Whether short training scripts exit 0 on every rank: `python -m benchmarks.clean_exits [--launches 60]
[--parallel 3] [--cases bare sp async] [--tag T]`.

Each launch is `torchrun --standalone --nproc-per-node 4` of a user script written without the trainer (this
module's `worker`): lay a tiny Llama out on tp=4 (`sp`: tp=4,sp), train 3 AdamW steps, write each rank's loss
to a file, then end as scripts do: `destroy_process_group()` guarded by `is_initialized()`, twice (once in a
`finally`, once at the end). `async`: the same with an `AsyncSaver` checkpoint started after the last step and
never waited for, so the script ends with the writer in flight. `--parallel` launches run at once (16
processes on a few cores for the default), which is the load under which an exit used to abort.
A launch passes when torchrun exits 0, every rank wrote its loss and, for `async`, the checkpoint is committed.
Prints one JSON line per launch that fails and a summary; with `--tag` (or `--write`) also writes
benchmarks/results/<date>-<device>-clean-exits[-T].{json,md}.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

CASES = ("bare", "sp", "async")
STEPS = 3


def worker(case: str, out: Path) -> None:
    """The user script: no trainer, no exit_process; what a reader of the README would write."""
    import torch
    import torch.distributed as dist

    import spmd
    from models.llama import Llama, LlamaConfig
    from spmd import checkpoint

    torch.set_num_threads(1)
    try:
        mesh = spmd.make_mesh("tp=4")
        torch.manual_seed(0)
        model = Llama(LlamaConfig.preset("tiny", kernels="torch"))
        spmd.parallelize(model, mesh, spmd.Rules.default(sequence_parallel=case == "sp"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        for _ in range(STEPS):
            tokens = torch.randint(0, 512, (4, 33), generator=generator)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        if case == "async":  # started, never waited for: the script ends with the writer in flight
            checkpoint.AsyncSaver().save(
                out / "ckpt", STEPS, checkpoint.model_state(model), checkpoint.optim_state(model, opt)
            )
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"loss": loss.item()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(case: str, timeout_s: float) -> dict:
    """One torchrun launch of `worker`: its exit code, the ranks that wrote results, and the failure's output."""
    from benchmarks import common

    with tempfile.TemporaryDirectory(prefix="spmd-exit-") as tmp:
        cmd = common.torchrun(4) + ["-m", "benchmarks.clean_exits", "--worker", case, "--out", tmp]
        env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = (
                "timeout",
                (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"),
            )
        wrote = sorted(int(p.stem[4:]) for p in Path(tmp).glob("rank*.json"))
        committed = (Path(tmp) / "ckpt" / "latest").exists() if case == "async" else True
    ok = rc == 0 and wrote == [0, 1, 2, 3] and committed
    row = {
        "case": case,
        "rc": rc,
        "ranks_wrote": wrote,
        "committed": committed,
        "ok": ok,
        "seconds": round(time.monotonic() - start, 1),
    }
    if not ok:
        row["aborted"] = "terminate called" in output or "Signal 6" in output or "SIGABRT" in output
        row["output_tail"] = common.portable(output[-3000:].replace(tmp, "<tmp>"))
    return row


def run(cases, launches: int, parallel: int, timeout_s: float = 300) -> list[dict]:
    """`launches` launches of each case, interleaved, `parallel` at a time."""
    order = [case for _ in range(launches) for case in cases]
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda case: launch(case, timeout_s), order))


def summary(rows: list[dict]) -> dict:
    by_case = {}
    for row in rows:
        s = by_case.setdefault(row["case"], {"launches": 0, "failed": 0, "aborted": 0})
        s["launches"] += 1
        s["failed"] += not row["ok"]
        s["aborted"] += bool(row.get("aborted"))
    return by_case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--launches", type=int, default=20, help="launches of each case")
    ap.add_argument("--parallel", type=int, default=3, help="launches running at once")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a launch counts as hung")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--write", action="store_true", help="write a results file (implied by --tag)")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.out)
        return 0
    from benchmarks import common

    start, environment = time.monotonic(), common.environment()  # the code the launches run
    rows = run(a.cases, a.launches, a.parallel, a.timeout)
    for row in rows:
        if not row["ok"]:
            print(json.dumps(row), flush=True)
    counts = summary(rows)
    report = {
        "environment": environment,
        "parallel": a.parallel,
        "summary": counts,
        "seconds": round(time.monotonic() - start),
        "failures": [r for r in rows if not r["ok"]],
    }
    print(json.dumps({"summary": counts, "seconds": report["seconds"]}))
    if a.tag or a.write:
        lines = [
            f"# Clean exits: {a.parallel} launches of 4 processes at once",
            "",
            "| case | launches | failed | aborted |",
            "|---|---|---|---|",
        ]
        lines += [f"| {c} | {s['launches']} | {s['failed']} | {s['aborted']} |" for c, s in counts.items()]
        stem = (
            common.ROOT
            / "benchmarks"
            / "results"
            / "-".join(filter(None, [common.today(), common.device_slug(), "clean-exits", a.tag]))
        )
        common.write(stem, report, "\n".join(lines))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
