"""Peak tensor memory per rank, spmd against torch-native, measured from the tensors themselves.

    python -m benchmarks.tensor_memory --model small --nproc 4 --specs dp=4 fsdp=4 "dp=2,fsdp=2" tp=4 "fsdp=2,tp=2,sp"

On a GPU the trainers report the CUDA allocator's peak (tensor bytes). On CPU they can only report the
process's peak resident set, which also holds the interpreter and what the C allocator keeps after tensors
are freed (glibc serves blocks under its mmap threshold from heaps it does not return), so two trainers
with the same tensors can differ there by tens of MiB. This benchmark measures what the allocator peak
measures on a GPU: each rank runs its trainer (`launch.train`, `benchmarks.native_train`; same model,
data, batch and optimizer as benchmarks.mfu) under a dispatch mode that sees every op's output, counts each
storage once while it lives (a view shares its base's storage) and keeps the largest total. Model build,
optimizer state and every step are inside; the trainer's own buffers made by ops are too (DDP's buckets,
FSDP2's all-gather outputs, spmd's flat buffers). Not seen: scratch a kernel or a gloo thread allocates and
frees inside one op, the same for both trainers. Step times under the mode mean nothing and are not reported.

Writes benchmarks/results/<date>-<device>-<model>-tensor-memory.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

from benchmarks import common
from benchmarks.mfu import trainer_args

TRAINERS = {"spmd": "launch.train", "native": "benchmarks.native_train"}


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages made by ops since it was entered and still alive (`now`), and their maximum
    (`peak`). A tensor subclass (DTensor) is left to its own dispatch, which runs its ops on plain local
    tensors: those are what is counted."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}  # storage id -> (bytes, weak reference whose callback uncounts it)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t) and t.device.type != "meta":
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in self.live or size == 0:
            return
        self.live[key] = (size, weakref.ref(storage, lambda _, k=key: self._uncount(k)))
        self.now += size
        self.peak = max(self.peak, self.now)

    def _uncount(self, key) -> None:
        self.now -= self.live.pop(key)[0]


def worker(out_dir: str, module: str, argv: list[str]) -> None:
    """One rank: the trainer `module`'s main(argv) under the tracker; writes its peak to out_dir/rank<R>.json."""
    from spmd.layout.mesh import exit_process

    tracker = LiveTensorBytes()
    with tracker:
        code = importlib.import_module(module).main(argv)
    rank = int(os.environ.get("RANK", 0))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": tracker.peak}))
    exit_process(code)


def measure(a, impl: str, spec: str | None, out: Path) -> dict:
    """{rank: peak bytes} of one run of `impl` ("spmd", "native", or "single": spmd's trainer on one process)."""
    out.mkdir(parents=True)
    launcher = common.torchrun(a.nproc) if spec else [sys.executable]
    module = TRAINERS["spmd" if impl == "single" else impl]
    cmd = launcher + ["-m", "benchmarks.tensor_memory", "--worker", str(out), module] + trainer_args(a, spec)
    cmd += ["--no-record-comm"] if impl == "native" else []
    common.run(cmd, timeout=a.timeout, env={"OMP_NUM_THREADS": "1"})
    return {int(f.stem[4:]): json.loads(f.read_text())["peak_bytes"] for f in sorted(out.glob("rank*.json"))}


def markdown(rep: dict) -> str:
    env, a = rep["environment"], rep["args"]
    lines = [
        f"# Peak tensor memory per rank: {a['model']} on {a['nproc']} x {env['device']}",
        "",
        f"{env['date']}, torch {env['torch']}, commit {env['commit'][:12]}; global batch "
        f"{a['batch_size']} x {a['seq_len']}, {a['dtype']}, AdamW, {a['steps']} steps. Bytes of the storages "
        f"alive at once, counted from every op's output on each rank (benchmarks/tensor_memory.py says what is "
        f"and is not seen); the largest rank.",
        "",
    ]
    rows = []
    if "single" in rep:
        rows.append(["1 device", "plain PyTorch", f"{max(rep['single'].values()) / 2**20:,.2f}", ""])
    for spec, r in rep["specs"].items():
        ours, native = max(r["spmd"].values()), max(r["native"].values())
        rows.append([spec, "spmd", f"{ours / 2**20:,.2f}", f"{ours / native:.3f}"])
        rows.append([spec, "native", f"{native / 2**20:,.2f}", ""])
    lines.append(common.md_table(["spec", "impl", "peak tensor MiB/rank", "spmd / native"], rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2], argv[3:])  # ends the process
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--specs", nargs="+", default=["dp=4", "fsdp=4", "dp=2,fsdp=2", "tp=4", "fsdp=2,tp=2,sp"])
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the peak comes once optimizer state exists)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=5)
    ap.add_argument("--no-single", action="store_true", help="skip the one-device baseline")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(common.RESULTS))
    a = ap.parse_args(argv)
    report = {"environment": common.environment(), "args": vars(a), "specs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if not a.no_single:
            report["single"] = measure(a, "single", None, Path(tmp, "single"))
        for i, spec in enumerate(a.specs):
            report["specs"][spec] = {
                impl: measure(a, impl, spec, Path(tmp, f"{i}-{impl}")) for impl in ("spmd", "native")
            }
            print(
                f"[tensor_memory] {spec}: "
                + ", ".join(f"{k} {max(v.values()) / 2**20:,.2f} MiB" for k, v in report["specs"][spec].items()),
                flush=True,
            )
    stem = Path(a.out) / f"{common.today()}-{common.device_slug()}-{a.model}-tensor-memory"
    js, md = common.write(stem, report, markdown(report))
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
