"""How long a checkpoint save blocks the training loop: `python -m benchmarks.checkpoint_blocking
[--models tiny small] [--nproc 4] [--repeats 5] [--tag T]`.

Each model is laid out as the trainer lays it out (`launch.setup.build_model`, fsdp over `nproc` gloo CPU
processes) with AdamW state, and saved `repeats` times (after one untimed save) the way the trainer saves it.
Modes: `sync` (`spmd.checkpoint.save`) and `async` (`AsyncSaver.save`, the trainer's default).
Blocked: the time from calling the save to its return, the loop's cost; per repeat the slowest rank counts
(the next step's collectives wait for it), reported as the median over repeats. Committed: until `latest`
names the checkpoint (for `async`, the benchmark waits for it before the next repeat, as a loop whose steps
between saves outlast the writing would find it done).
Writes benchmarks/results/<date>-<device>-checkpoint-blocking[-T].{json,md}.
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common

MODES = ("sync", "async")


def _worker(a) -> None:
    import torch
    import torch.distributed as dist

    from launch.config import load_config
    from launch.setup import build_model
    from spmd import checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(["--model", a.model, "--mesh", f"fsdp={world}"])
    model, *_ = build_model(cfg, cfg.model_config(), world, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.optim_state(model, opt, init=True)
    out = {}
    with tempfile.TemporaryDirectory() if rank == 0 else contextlib.nullcontext() as root:
        root = [root]
        dist.broadcast_object_list(root)
        for mode in a.modes:
            ckpt_dir = Path(root[0]) / mode
            blocked, committed = [], []
            saver = checkpoint.AsyncSaver() if mode == "async" else None
            for i in range(a.repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                path = (saver.save if saver else checkpoint.save)(
                    ckpt_dir,
                    i,
                    checkpoint.model_state(model),
                    checkpoint.optim_state(model, opt),
                    meta={"repeat": i},
                    keep=2,
                )
                blocked_s = time.perf_counter() - t0
                if saver:
                    saver.wait()
                committed_s = time.perf_counter() - t0
                times = [None] * world
                dist.all_gather_object(times, (blocked_s, committed_s))
                if i:  # the first save creates the directory and warms the allocator
                    blocked.append(max(b for b, _ in times))
                    committed.append(max(c for _, c in times))
            size = sum(f.stat().st_size for f in path.iterdir())
            out[mode] = {
                "blocked_s": statistics.median(blocked),
                "committed_s": statistics.median(committed),
                "blocked_all_s": blocked,
                "bytes": size,
            }
        dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--tag", default="", help="appended to the results file's name")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    rows, report = [], {"environment": common.environment(), "nproc": a.nproc, "repeats": a.repeats, "models": {}}
    for name in a.models:
        proc = common.run(
            [
                *common.torchrun(a.nproc),
                "-m",
                "benchmarks.checkpoint_blocking",
                "--worker",
                "--model",
                name,
                "--repeats",
                str(a.repeats),
                "--modes",
                *a.modes,
            ],
            env={"OMP_NUM_THREADS": "1"},
        )
        result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
        report["models"][name] = result
        for mode, r in result.items():
            rows.append([name, mode, r["bytes"] / 2**20, r["blocked_s"] * 1e3, r["committed_s"] * 1e3])
    table = common.md_table(
        ["model", "save", "checkpoint MiB", "loop blocked ms (median)", "until committed ms (median)"], rows
    )
    env = report["environment"]
    markdown = (
        f"# Checkpoint save: time the training loop is blocked\n\n{env['device']}, {a.nproc} gloo "
        f"processes (fsdp={a.nproc}), {a.repeats} repeats, slowest rank per repeat; commit "
        f"{env['commit'][:10]}, load {env.get('loadavg_1m', 0):.1f}\n\n{table}\n"
    )
    return common.publish(f"checkpoint-blocking{'-' + a.tag if a.tag else ''}", report, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
