"""ZeRO-1's step reduction in flat buffers: the gradients backward left unreduced reach their optimizer
shards in one reduce-scatter per mesh axis (and one all-reduce per axis that keeps them replicated), as
DDP's and FSDP's buckets do, instead of one collective per parameter.

Each gradient is first sliced onto the shards it already may keep (free), as `gradients.reduce_to` does.
Then, per mesh axis that turns a partial sum into a shard, every gradient's chunks (DTensor's own split
along its shard dim) are laid out rank by rank in one buffer, each rank's segment padded to the longest;
one reduce-scatter leaves each rank its segment, which splits back into the shards. The bytes on the wire
are the per-parameter reductions' (plus any padding of uneven chunks). A gradient whose target shards one
dim over two mesh axes takes the per-parameter path.
"""
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import tags
from .gradients import reduce_to, slice_onto_shards

__all__ = ["reduce_all_to"]


def reduce_all_to(grads: list, targets: list, why: str) -> list:
    """[g.redistribute(target)] for DTensor gradients whose placements are partial sums or already the
    targets', in one collective per mesh axis and kind; `why` tags them for the collective recorder."""
    out = list(grads)
    flat = [i for i, (g, t) in enumerate(zip(grads, targets)) if _bucketable(g, t)]
    for i in set(range(len(grads))) - set(flat):
        out[i] = reduce_to(grads[i], targets[i])
    if not flat:
        return out
    mesh = grads[flat[0]].device_mesh
    locals_ = {i: slice_onto_shards(grads[i], targets[i]) for i in flat}
    current = {i: list(locals_[i].placements) for i in flat}
    locals_ = {i: t.to_local() for i, t in locals_.items()}
    for m in range(mesh.ndim):
        members = [i for i in flat if current[i][m].is_partial() and targets[i][m].is_shard()]
        if members:
            with tags.reason("", f"{why} (one reduce-scatter over {mesh.mesh_dim_names[m]})"):
                locals_.update(_reduce_scatter(mesh, m, {i: (locals_[i], targets[i][m].dim) for i in members}))
            for i in members:
                current[i][m] = targets[i][m]
    for m in range(mesh.ndim):
        members = [i for i in flat if current[i][m].is_partial()]
        if members:
            with tags.reason("", f"{why} (one all-reduce over {mesh.mesh_dim_names[m]})"):
                locals_.update(_all_reduce(mesh, m, {i: locals_[i] for i in members}))
            for i in members:
                current[i][m] = Replicate()
    for i in flat:
        g = grads[i]
        out[i] = DTensor.from_local(locals_[i], mesh, targets[i], run_check=False, shape=g.shape, stride=g.stride())
    return out


def _bucketable(g: DTensor, target) -> bool:
    dims = [t.dim for t in target if t.is_shard()]
    return (len(dims) == len(set(dims)) and all(not p.is_partial() or p.reduce_op == "sum" for p in g.placements)
            and all(p == t or p.is_partial() or (p.is_replicate() and t.is_shard())
                    for p, t in zip(g.placements, target)))


def _reduce_scatter(mesh, m: int, members: dict) -> dict:
    """{i: (local, shard dim)} -> {i: this rank's shard of the sum over mesh axis m}."""
    n, rank = mesh.size(m), mesh.get_local_rank(m)
    chunks = {i: _chunks(t, d, n) for i, (t, d) in members.items()}
    seg = max(sum(c[r].numel() for c in chunks.values()) for r in range(n))
    rows = []
    for r in range(n):
        row = torch.cat([c[r].reshape(-1) for c in chunks.values()])
        rows.append(torch.nn.functional.pad(row, (0, seg - row.numel())))
    mine = funcol.reduce_scatter_single(torch.cat(rows), "sum", 0, (mesh, m))
    mine = mine.wait() if hasattr(mine, "wait") else mine
    out, at = {}, 0
    for i, c in chunks.items():
        out[i] = mine[at:at + c[rank].numel()].view(c[rank].shape)
        at += c[rank].numel()
    return out


def _chunks(t: torch.Tensor, dim: int, n: int) -> list:
    pieces, _ = Shard(dim)._split_tensor(t, n, with_padding=False)
    return pieces


def _all_reduce(mesh, m: int, members: dict) -> dict:
    flat = torch.cat([t.reshape(-1) for t in members.values()])
    summed = funcol.all_reduce(flat, "sum", (mesh, m))
    summed = summed.wait() if hasattr(summed, "wait") else summed
    out, at = {}, 0
    for i, t in members.items():
        out[i] = summed[at:at + t.numel()].view(t.shape)
        at += t.numel()
    return out
