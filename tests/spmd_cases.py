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


def norm_rel_errs(pairs) -> dict:
    """{name: norm_rel_err(actual.full_tensor(), expected)}, as on this rank, for each (name, actual DTensor,
    expected whole tensor) of `pairs`, in one collective instead of a gather per tensor: each rank compares its
    own shard with DTensor's split of `expected` (`distribute_tensor(..., src_data_rank=None)`, no
    communication), and the squared norms are summed over the ranks holding the other shards of this rank's
    copy. Every rank of the world calls it at once (a pipeline stage with its own parameters); a tensor with
    partial sums is gathered as before."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    local, gathered = [], {}
    for name, actual, expected in pairs:
        if any(p.is_partial() for p in actual.placements):
            gathered[name] = norm_rel_err(actual.full_tensor().to(expected.dtype), expected)
            local.append(torch.zeros(2, dtype=torch.float64))
            continue
        piece = distribute_tensor(expected, actual.device_mesh, actual.placements, src_data_rank=None).to_local()
        mine = actual.to_local()
        assert mine.shape == piece.shape, (name, mine.shape, piece.shape)
        mine, piece = mine.detach().double(), piece.double()
        local.append(torch.stack([(mine - piece).square().sum(), piece.square().sum()]))
    count = torch.tensor(len(local))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # a pipeline stage holds its own parameters: pad to the most
    stats = torch.zeros(int(count), 2, dtype=torch.float64)
    stats[: len(local)] = torch.stack(local) if local else stats[:0]
    every = stats.new_empty(dist.get_world_size() * len(stats), 2)
    dist.all_gather_into_tensor(every, stats)
    every = every.view(-1, *stats.shape)
    errs = {}
    for i, (name, actual, _) in enumerate(pairs):
        if name in gathered:
            errs[name] = gathered[name]
            continue
        mesh, coords = actual.device_mesh, actual.device_mesh.get_coordinate()
        index = tuple(slice(None) if not p.is_replicate() else c for p, c in zip(actual.placements, coords))
        diff, ref = every[mesh.mesh[index].flatten(), i].sum(0).tolist()
        errs[name] = (diff / max(ref, 1e-24)) ** 0.5
    return errs
