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
(benchmarks/search_vs_measured.py measures them and passes a `Device` of its own). Gloo moves data on the
same cores that compute, so a collective hides behind compute only when the ranks leave the cores to do it:
with more threads than cores, nothing overlaps (`overlaps_comm`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from ..layout.dtypes import dtype_name

__all__ = ["Device", "GPU_PEAKS", "gpu_peaks", "DEVICES", "measure_gemm_flops", "cpu_device", "get_device"]

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
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        best = 0.0
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            torch.mm(a, b)
            sync()
            end = time.perf_counter() + budget_s / len(sizes)
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                torch.mm(a, b)
                sync()
                best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(old)
    _measured[key] = best
    return best


def cpu_device(
    world: int = 1,
    threads_per_rank: int = 1,
    peak_per_thread: float | None = None,
    bandwidth: float = CPU_BW,
    latency: float = CPU_LATENCY,
    step_latency: float = CPU_STEP_LATENCY,
) -> Device:
    """This machine as a device for `world` processes of `threads_per_rank` threads each (torchrun's default
    is 1). When the processes want more threads than there are cores, each gets its share."""
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
