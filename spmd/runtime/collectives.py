"""Many tensors reduced or gathered over one mesh axis (or one flattened group of axes) in one collective: each
tensor's chunks laid out rank by rank (uneven chunks padded), issued at once and waited on when read. On a `wire`
naming a format, a collective over more than one rank travels quantized (wire.flat).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard

from ..layout.mesh import group_over
from .wire import flat as wire_flat
from .wire.quantize import BLOCKWISE

__all__ = [
    "wait",
    "Flat",
    "reduce_scatter",
    "all_reduce",
    "all_gather",
    "all_gather_buffer",
    "all_gather_dims",
    "unpack",
]


def wait(t: torch.Tensor) -> torch.Tensor:
    """The value of a collective issued through functional collectives (a plain tensor passes through)."""
    return t.wait() if isinstance(t, (funcol.AsyncCollectiveTensor, wire_flat.Pending)) else t


class Flat:
    """An issued flat reduction: `results()` waits for it and gives this rank's piece of each input, as views."""

    def __init__(self, out: torch.Tensor, shapes: list, work=None):
        self.out, self.shapes, self.work = out, shapes, work  # work: a c10d collective writing into `out`

    def results(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        sizes = [shape.numel() for shape in self.shapes]  # (an uneven reduce-scatter's padding after them)
        pieces = wait(self.out)[: sum(sizes)].split(sizes)
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]


def _segment(chunks: list, n: int) -> int:
    """The longest rank's segment: per tensor its n chunks (tensors or shapes), summed rank by rank."""
    return max(sum(c[r].numel() for c in chunks) for r in range(n))


def _padded(row: list, seg: int) -> list:
    """A rank's flattened chunks, with zeros after them up to the segment's length."""
    short = seg - sum(x.numel() for x in row)
    return row + ([row[0].new_zeros(short)] if short else [])


def reduce_scatter(tensors: list, dims: list, mesh, m: int, wire=None) -> Flat:
    """Sums `tensors` over mesh dim `m`; each rank receives its chunk of each along its dim in `dims`."""
    n, rank = mesh.size(m), mesh.get_local_rank(m)
    if all(t.shape[d] % n == 0 for t, d in zip(tensors, dims)):  # rank r's rows side by side, a few ops a tensor
        rows = [t.unflatten(d, (n, t.shape[d] // n)).movedim(d, 0) for t, d in zip(tensors, dims)]
        packed, shapes = torch.cat([r.reshape(n, -1) for r in rows], dim=1), [r.shape[1:] for r in rows]
    else:
        chunks = [Shard(d)._split_tensor(t, n, with_padding=False)[0] for t, d in zip(tensors, dims)]
        seg = _segment(chunks, n)
        packed = torch.cat([x for r in range(n) for x in _padded([c[r].reshape(-1) for c in chunks], seg)])
        packed, shapes = packed.view(n, seg), [c[rank].shape for c in chunks]
    if wire is not None and wire.grads is not None and n > 1:
        return Flat(wire_flat.reduce_scatter(packed, wire.grads, wire.block_for(wire.grads), (mesh, m)), shapes)
    return Flat(funcol.reduce_scatter_single(packed.reshape(-1), "sum", 0, (mesh, m)), shapes)


def all_reduce(tensors: list, mesh, dims, wire=None) -> Flat:
    """Sums `tensors` over mesh dim(s) `dims` (several: one flattened group); every rank receives each whole."""
    dims = (dims,) if isinstance(dims, int) else dims
    group = group_over(mesh, dims)
    out = torch.cat([t.reshape(-1) for t in tensors])
    if wire is not None and wire.grads is not None:
        # hop by hop without a flattened group: the inner axis (inside a node) first, as qgZ
        for g in [group] if group is not None else [mesh.get_group(m) for m in sorted(dims, reverse=True)]:
            n = dist.get_world_size(g)
            out = out if n == 1 else wire_flat.all_reduce(out, wire.grads, wire.block_for(wire.grads), g, n)
        return Flat(out, [t.shape for t in tensors])
    work = None
    for g in [group] if group is not None else [mesh.get_group(m) for m in dims]:  # else axis by axis
        if work is not None:
            work.wait()
        # in place, as DDP's buckets (funcol's all_reduce copies its input; its in-place one escapes CommDebugMode)
        work = dist.all_reduce(out, group=g, async_op=True)
    return Flat(out, [t.shape for t in tensors], work)


def all_gather(tensors: list, dims: list, shapes: list, mesh, m: int, wire=None) -> list:
    """The whole tensors of `shapes` from each rank's chunk (`tensors`), split along `dims` over mesh dim `m`."""
    n = mesh.size(m)
    metas = [
        Shard(d)._split_tensor(torch.empty(s, device="meta"), n, with_padding=False)[0] for s, d in zip(shapes, dims)
    ]
    chunks = [[c.shape for c in cut] for cut in metas]
    seg = _segment(chunks, n)
    buf = torch.cat(_padded([t.reshape(-1) for t in tensors], seg))
    return unpack(wait(all_gather_buffer(buf, mesh, m, wire)).view(n, seg), chunks, dims)


def unpack(gathered: torch.Tensor, chunks: list, dims: list) -> list:
    """The whole tensors in an all-gather's rows (one a rank, chunks of `chunks`' shapes), joined along `dims`."""
    n, out, at = gathered.shape[0], [], [0] * gathered.shape[0]
    for c, d in zip(chunks, dims):
        if all(x == c[0] for x in c) and all(a == at[0] for a in at):  # every rank's at one offset: one op
            parts = gathered[:, at[0] : at[0] + c[0].numel()].view(n, *c[0]).unbind(0)
        else:
            parts = [gathered[r, at[r] : at[r] + c[r].numel()].view(c[r]) for r in range(n)]
        out.append(torch.cat(parts, dim=d))
        at = [a + x.numel() for a, x in zip(at, c)]
    return out


def all_gather_buffer(buffer: torch.Tensor, mesh, m: int, wire=None) -> torch.Tensor:
    """Every rank's flat `buffer` over mesh dim `m`, back to back; issued now, waited on when read."""
    if wire is not None and wire.params in BLOCKWISE and mesh.size(m) > 1:
        return wire_flat.gather(buffer, wire.params, wire.block_for(wire.params), (mesh, m), mesh.size(m))
    return wire_flat.all_gather_single(buffer, 0, (mesh, m))


def all_gather_dims(local: torch.Tensor, dims: dict, mesh, wire=None) -> torch.Tensor:
    """A tensor's equal-on-every-rank shards gathered over each mesh dim of `dims` ({mesh dim: tensor dim})."""
    for m in sorted(dims):
        n = mesh.size(m)
        rows = wait(all_gather_buffer(local.reshape(-1), mesh, m, wire)).view(n, -1)
        local = unpack(rows, [[local.shape] * n], [dims[m]])[0]
    return local
