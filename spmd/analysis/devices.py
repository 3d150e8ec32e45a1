"""The table of accelerators: dense peak FLOP/s per dtype (read by `spmd.search` and by launch's MFU), memory,
link bandwidths and latencies, and the GEMM probe that measures a peak where the table has none.

Peaks are dense tensor-core figures; fp32 matmuls run as TF32 where `torch.backends.cuda.matmul.allow_tf32`
is on (the search assumes it is), else at the plain fp32 figure.

Bandwidths are what a rank can push through one link in one direction with a ring collective (NCCL bus
bandwidth as measured by nccl-tests, a little under the nominal figure), in bytes/s, so that a collective's
time is `latency + steps x step_latency + bytes_on_the_wire / bandwidth` with the bytes and the ring steps of
spmd.analysis.record's convention (an all-reduce over n ranks takes 2(n-1) steps, an all-gather n-1): the
alpha-beta model of ring collectives, the form of NCCL's own tuning model (a base latency plus a latency per
step, ring steps of 0.5-3.4 us over NVLink and 3-14 us over the network depending on the protocol).
Within a node: NVLink (H100/H200 NVLink4 450 GB/s nominal per direction, A100 NVLink3 300 GB/s). Across nodes:
one InfiniBand NIC per GPU (H100/H200 NDR 400 Gb/s = 50 GB/s, A100 HDR 200 Gb/s = 25 GB/s).
`efficiency` is the fraction of the dense peak a training step's matmuls reach (MFU of well-tuned large-model
training is 40-55% on these parts); it is one stated constant, the same for every spec.

The CPU entry is this machine: peak = its best measured GEMM FLOP/s (per process, scaled down when more
processes than cores run), all ranks on one "node", links = gloo over loopback with stated defaults
(benchmarks/search_vs_measured.py passes a `Device` of its own: compute at `measure_linear_flops` of the
model's own shapes, a `Link` per collective kind fitted to collectives timed inside real steps, in
`kind_links`). Gloo moves data on the same cores that compute, so a collective hides behind compute only
when the ranks leave the cores to do it: with more threads than cores, nothing overlaps (`overlaps_comm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ..layout.dtypes import dtype_name

__all__ = [
    "Device",
    "Link",
    "GPU_PEAKS",
    "gpu_peaks",
    "DEVICES",
    "measure_gemm_flops",
    "measure_linear_flops",
    "cpu_device",
    "get_device",
]

# (name fragment, {dtype: dense peak FLOP/s}); the first fragment found in a device name wins
GPU_PEAKS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
]


def gpu_peaks(name: str) -> tuple[str, dict] | None:
    """(fragment, peaks) of the first GPU_PEAKS entry whose fragment is in the device name `name`."""
    return next(((f, peaks) for f, peaks in GPU_PEAKS if f in name), None)


@dataclass(frozen=True)
class Link:
    """One collective kind's figures: t = latency + ring steps x step_latency + wire bytes / bandwidth."""

    latency: float
    step_latency: float
    bandwidth: float


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict  # dtype -> dense FLOP/s per device
    memory_bytes: float  # per device (CPU: the machine's RAM, shared by its processes)
    intra_bw: float  # bytes/s per rank, one direction, within a node
    inter_bw: float  # bytes/s per rank, one direction, across nodes
    intra_latency: float  # seconds per collective within a node, whatever its size (launch, setup)
    inter_latency: float  # seconds per collective across nodes
    per_node: int = 8  # devices per node
    efficiency: float = 0.5  # fraction of peak reached by the step's compute
    shared_memory: bool = False  # CPU: all processes share memory_bytes
    intra_step_latency: float = 0.0  # seconds per ring step (record.ring_steps) within a node
    inter_step_latency: float = 0.0  # seconds per ring step across nodes
    overlaps_comm: bool = True  # a collective progresses while the rank computes (step_time's `hidden`)
    # ((collective kind, Link), ...): figures fitted per kind on one node (the CPU entry), used for that kind on
    # every link in place of the intra/inter figures; a kind not listed takes those
    kind_links: tuple = ()

    def link(self, kind: str, inter: bool) -> Link:
        """The figures a collective of `kind` (record.Collective.kind) is priced with, across nodes or not."""
        for k, fitted in self.kind_links:
            if k == kind:
                return fitted
        if inter:
            return Link(self.inter_latency, self.inter_step_latency, self.inter_bw)
        return Link(self.intra_latency, self.intra_step_latency, self.intra_bw)

    def peak(self, dtype) -> float:
        key = dtype_name(dtype)
        if key == "fp32" and "tf32" in self.peak_flops:
            key = "tf32"
        return self.peak_flops.get(key) or self.peak_flops["fp32"]

    def memory_per_rank(self, world: int) -> float:
        return self.memory_bytes / min(world, self.per_node) if self.shared_memory else self.memory_bytes

    def replace(self, **changes) -> Device:
        return dataclasses.replace(self, **changes)


_NCCL_LATENCY = dict(intra_latency=10e-6, inter_latency=10e-6, intra_step_latency=2e-6, inter_step_latency=5e-6)
DEVICES = {
    "h100": Device("H100 SXM 80GB", gpu_peaks("H100")[1], 80e9, intra_bw=360e9, inter_bw=45e9, **_NCCL_LATENCY),
    "h200": Device("H200 SXM 141GB", gpu_peaks("H200")[1], 141e9, intra_bw=360e9, inter_bw=45e9, **_NCCL_LATENCY),
    "a100": Device("A100 SXM 80GB", gpu_peaks("A100")[1], 80e9, intra_bw=230e9, inter_bw=22e9, **_NCCL_LATENCY),
}

# gloo over loopback TCP on one machine: stated defaults, replace with measured ones where it matters
CPU_BW = 1.0e9
CPU_LATENCY = 50e-6
CPU_STEP_LATENCY = 50e-6
_measured: dict = {}


def measure_gemm_flops(
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    budget_s: float = 1.0,
    threads: int | None = None,
    sizes=None,
) -> float:
    """Best FLOP/s of square matmuls on `device` (with `threads` CPU threads), within about `budget_s` seconds;
    n = 256..2048 on CUDA and for fp32, 256..512 for reduced precision on CPU, unless `sizes` says."""
    key = (dtype, str(device), threads, tuple(sizes or ()))
    if key in _measured:
        return _measured[key]
    cuda = str(device).startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = sizes or ((256, 512, 1024, 2048) if cuda or dtype == torch.float32 else (256, 512))
    best = 0.0
    with _threads(threads):
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            seconds = _best_seconds(lambda: torch.mm(a, b), budget_s / len(sizes), sync)
            best = max(best, 2 * n**3 / seconds)
    _measured[key] = best
    return best


def measure_linear_flops(
    model: torch.nn.Module, tokens: int, dtype: torch.dtype = torch.float32, threads: int | None = 1, budget_s=1.0
) -> float:
    """FLOP/s of the matmuls of `model`'s nn.Linear layers at `tokens` rows (a rank's share of the batch), on
    this CPU with `threads` threads: each layer's forward and backward products (x W^T, g W, g^T x) at its own
    shape, best time of each within about `budget_s` seconds in all, FLOPs over time summed over the layers
    (a shape as often as layers have it). `model` may live on the meta device: only its shapes are read."""
    shapes = Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    if not shapes:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to probe: use measure_gemm_flops")
    seconds = 0.0
    with _threads(threads):
        for (k, m), n in shapes.items():
            x, w, g = (torch.randn(*s).to(dtype) for s in ((tokens, k), (m, k), (tokens, m)))
            seconds += n * _best_seconds(lambda: (x @ w.T, g @ w, g.T @ x), budget_s / len(shapes))
    return sum(6 * tokens * k * m * n for (k, m), n in shapes.items()) / seconds


@contextlib.contextmanager
def _threads(threads: int | None):
    """torch's intra-op threads set to `threads` (unchanged for None) inside the block."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _best_seconds(run, budget_s: float, sync=lambda: None) -> float:
    """The best time of `run()` (after one untimed call) over the calls that fit in about `budget_s`, one at
    least; `sync` waits for a device's queued work."""
    run()
    sync()
    best, end = math.inf, time.perf_counter() + budget_s
    while time.perf_counter() < end or best == math.inf:
        t0 = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_device(
    world: int = 1,
    threads_per_rank: int = 1,
    peak_per_thread: float | None = None,
    bandwidth: float = CPU_BW,
    latency: float = CPU_LATENCY,
    step_latency: float = CPU_STEP_LATENCY,
    kind_links: dict | None = None,
) -> Device:
    """This machine as a device for `world` processes of `threads_per_rank` threads each (torchrun's default
    is 1). When the processes want more threads than there are cores, each gets its share. `kind_links`:
    {collective kind: Link} fitted per kind (Device.kind_links), over the single link's figures."""
    cores = os.cpu_count() or 1
    per_thread = peak_per_thread or measure_gemm_flops(torch.float32, threads=1, budget_s=0.6, sizes=(256, 512, 1024))
    share = min(1.0, cores / max(1, world * threads_per_rank))
    peak = per_thread * threads_per_rank * share
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8e9
    return Device(
        f"cpu x{cores} cores",
        {"fp32": peak, "bf16": peak, "fp16": peak},
        float(ram),
        intra_bw=bandwidth,
        inter_bw=bandwidth,
        intra_latency=latency,
        inter_latency=latency,
        per_node=1 << 30,
        efficiency=1.0,
        shared_memory=True,
        intra_step_latency=step_latency,
        inter_step_latency=step_latency,
        overlaps_comm=world * threads_per_rank <= cores,
        kind_links=tuple(sorted((kind_links or {}).items())),
    )


def get_device(device, world: int = 1) -> Device:
    if isinstance(device, Device):
        return device
    name = str(device).lower()
    if name == "cpu":
        return cpu_device(world)
    if name not in DEVICES:
        raise ValueError(
            f"unknown device {device!r}; known: {sorted(DEVICES) + ['cpu']} (or pass a spmd.analysis.devices.Device)"
        )
    return DEVICES[name]
