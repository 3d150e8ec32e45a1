"""Shared pieces of the SPMD tests: the tiny model, its deterministic batches, the data-parallel slice, and
explain's plan for the tiny model."""

import functools

import torch

import spmd
from models.llama import Llama, LlamaConfig

BATCH, SEQ = 8, 16


def tiny_model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.preset("tiny", kernels="torch", **overrides))


@functools.cache
def plan_for(spec: str, ac: str = "none") -> spmd.Plan:
    """explain's plan for the tiny model and batch on a fake world of `spec` (cached: a fake world takes
    seconds, and several tests hold real runs against the same plan). Read it, never change it."""
    sizes, flags = spmd.parse_spec(spec)
    return spmd.explain(
        tiny_model(), spmd.Rules.default(sequence_parallel="sp" in flags), sizes, batch_shape=(BATCH, SEQ), ac=ac
    )


def global_batch(step: int, vocab: int = 512):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def data_parallel_rank(mesh) -> tuple[int, int]:
    """(rank, size) of this process among data-parallel replicas: dp outer, fsdp inner, as DTensor shards."""
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    sizes = spmd.mesh_sizes(mesh)
    return coords.get("dp", 0) * sizes["fsdp"] + coords.get("fsdp", 0), sizes["dp"] * sizes["fsdp"]


def local_slice(t: torch.Tensor, mesh) -> torch.Tensor:
    r, n = data_parallel_rank(mesh)
    b = t.shape[0] // n
    return t[r * b : (r + 1) * b]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def norm_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
