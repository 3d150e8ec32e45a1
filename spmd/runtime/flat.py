"""Many tensors summed over one mesh axis in one collective: packed into one flat buffer, cut back after.

A reduce-scatter lays each tensor's chunks along its shard dim (DTensor's own split, so uneven chunks are
allowed) out rank by rank, each rank's segment padded to the longest; each rank gets back its segment, its
chunk of every tensor. An all-reduce lays the tensors back to back. Both are issued at once and waited on
when the results are read, so a caller may go on while they travel. The bytes on the wire are those of the
per-tensor collectives (plus the padding of uneven chunks).

Used by the block buckets' gradient reductions (spmd.runtime.buckets), the reductions across blocks
(spmd.runtime.reducer) and ZeRO-1/2's step reductions (spmd.runtime.step_reduce).
"""
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard

__all__ = ["wait", "Flat", "reduce_scatter", "all_reduce"]


def wait(t: torch.Tensor) -> torch.Tensor:
    """The value of a collective issued through functional collectives (a plain tensor passes through)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class Flat:
    """An issued flat reduction: `results()` waits for it and gives this rank's piece of each input, as views."""

    def __init__(self, out: torch.Tensor, shapes: list):
        self.out, self.shapes = out, shapes

    def results(self) -> list[torch.Tensor]:
        flat, at, pieces = wait(self.out), 0, []
        for shape in self.shapes:
            k = shape.numel()
            pieces.append(flat[at:at + k].view(shape))
            at += k
        return pieces


def reduce_scatter(tensors: list, dims: list, mesh, m: int) -> Flat:
    """Sums `tensors` over mesh dim `m`; each rank receives its chunk of each along its dim in `dims`."""
    n, rank = mesh.size(m), mesh.get_local_rank(m)
    chunks = [Shard(d)._split_tensor(t, n, with_padding=False)[0] for t, d in zip(tensors, dims)]
    seg = max(sum(c[r].numel() for c in chunks) for r in range(n))
    parts = []
    for r in range(n):
        row = [c[r].reshape(-1) for c in chunks]
        short = seg - sum(x.numel() for x in row)
        parts += row + ([row[0].new_zeros(short)] if short else [])
    out = funcol.reduce_scatter_single(torch.cat(parts), "sum", 0, (mesh, m))
    return Flat(out, [c[rank].shape for c in chunks])


def all_reduce(tensors: list, mesh, m: int) -> Flat:
    """Sums `tensors` over mesh dim `m`; every rank receives each whole."""
    out = funcol.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), "sum", (mesh, m))
    return Flat(out, [t.shape for t in tensors])
