"""A small table of accelerators for `spmd.search`: peak FLOP/s, memory, link bandwidths and latencies.

Bandwidths are what a rank can push through one link in one direction with a ring collective (NCCL bus
bandwidth as measured by nccl-tests, a little under the nominal figure), in bytes/s, so that a collective's
time is `latency + bytes_on_the_wire / bandwidth` with the bytes of spmd.analysis.record's ring convention.
Within a node: NVLink (H100/H200 NVLink4 450 GB/s nominal per direction, A100 NVLink3 300 GB/s). Across nodes:
one InfiniBand NIC per GPU (H100/H200 NDR 400 Gb/s = 50 GB/s, A100 HDR 200 Gb/s = 25 GB/s).
`efficiency` is the fraction of the dense peak a training step's matmuls reach (MFU of well-tuned large-model
training is 40-55% on these parts); it is one stated constant, the same for every spec.

The CPU entry is this machine: peak = its best measured GEMM FLOP/s (per process, scaled down when more
processes than cores run), all ranks on one "node", links = gloo over loopback with stated defaults
(benchmarks/search_vs_measured.py measures them and passes a `Device` of its own).
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict          # dtype -> dense FLOP/s per device
    memory_bytes: float       # per device (CPU: the machine's RAM, shared by its processes)
    intra_bw: float           # bytes/s per rank, one direction, within a node
    inter_bw: float           # bytes/s per rank, one direction, across nodes
    intra_latency: float      # seconds per collective within a node
    inter_latency: float      # seconds per collective across nodes
    per_node: int = 8         # devices per node
    efficiency: float = 0.5   # fraction of peak reached by the step's compute
    shared_memory: bool = False  # CPU: all processes share memory_bytes

    def peak(self, dtype: str) -> float:
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
        return self.peak_flops.get(key) or self.peak_flops["fp32"]

    def memory_per_rank(self, world: int) -> float:
        return self.memory_bytes / min(world, self.per_node) if self.shared_memory else self.memory_bytes

    def replace(self, **changes) -> "Device":
        return dataclasses.replace(self, **changes)


# fp32 entries assume TF32 matmuls (PyTorch's default for cuDNN; `torch.backends.cuda.matmul.allow_tf32`)
DEVICES = {
    "h100": Device("H100 SXM 80GB", {"bf16": 989e12, "fp16": 989e12, "fp32": 494.5e12}, 80e9,
                   intra_bw=360e9, inter_bw=45e9, intra_latency=15e-6, inter_latency=30e-6),
    "h200": Device("H200 SXM 141GB", {"bf16": 989e12, "fp16": 989e12, "fp32": 494.5e12}, 141e9,
                   intra_bw=360e9, inter_bw=45e9, intra_latency=15e-6, inter_latency=30e-6),
    "a100": Device("A100 SXM 80GB", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, 80e9,
                   intra_bw=230e9, inter_bw=22e9, intra_latency=15e-6, inter_latency=30e-6),
}

# gloo over loopback TCP on one machine: stated defaults, replace with measured ones where it matters
CPU_BW = 1.0e9
CPU_LATENCY = 150e-6
_measured: dict = {}


def measure_gemm_flops(dtype: torch.dtype = torch.float32, threads: int | None = None, budget_s: float = 0.6) -> float:
    """Best FLOP/s of square fp32/bf16 matmuls (n = 256..1024) on this CPU with `threads` threads."""
    key = (dtype, threads)
    if key in _measured:
        return _measured[key]
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        best = 0.0
        for n in (256, 512, 1024):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            torch.mm(a, b)
            end = time.perf_counter() + budget_s / 3
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                torch.mm(a, b)
                best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(old)
    _measured[key] = best
    return best


def cpu_device(world: int = 1, threads_per_rank: int = 1, peak_per_thread: float | None = None,
               bandwidth: float = CPU_BW, latency: float = CPU_LATENCY) -> Device:
    """This machine as a device for `world` processes of `threads_per_rank` threads each (torchrun's default
    is 1). When the processes want more threads than there are cores, each gets its share."""
    cores = os.cpu_count() or 1
    per_thread = peak_per_thread or measure_gemm_flops(torch.float32, threads=1)
    share = min(1.0, cores / max(1, world * threads_per_rank))
    peak = per_thread * threads_per_rank * share
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8e9
    return Device(f"cpu x{cores} cores", {"fp32": peak, "bf16": peak, "fp16": peak}, float(ram),
                  intra_bw=bandwidth, inter_bw=bandwidth, intra_latency=latency, inter_latency=latency,
                  per_node=1 << 30, efficiency=1.0, shared_memory=True)


def get_device(device, world: int = 1) -> Device:
    if isinstance(device, Device):
        return device
    name = str(device).lower()
    if name == "cpu":
        return cpu_device(world)
    if name not in DEVICES:
        raise ValueError(f"unknown device {device!r}; known: {sorted(DEVICES) + ['cpu']} (or pass a spmd.analysis.devices.Device)")
    return DEVICES[name]
