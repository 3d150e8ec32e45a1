"""ZeRO-1's step reduction in flat buffers: the gradients backward left unreduced reach their optimizer shards in
one reduce-scatter per mesh axis (and one all-reduce over the replicating axes), not one collective per parameter.
A gradient is first sliced onto the shards it already may keep (free); one sharding a dim over two mesh axes takes
the per-parameter path.
"""

from torch.distributed.tensor import DTensor

from .. import collectives, tags
from ..dtensor.wrap import wrap_local
from .layouts import reduce_to, slice_onto_shards

__all__ = ["reduce_all_to", "reduce_grads"]


def reduce_all_to(grads: list, targets: list, why: str, wire=None) -> list:
    """[g.redistribute(target)] for partial or placed gradients, one collective per mesh axis and kind, on `wire`."""
    out = list(grads)
    flat = [i for i, (g, t) in enumerate(zip(grads, targets)) if _bucketable(g, t)]
    for i in set(range(len(grads))) - set(flat):
        out[i] = reduce_to(grads[i], targets[i])
    if not flat:
        return out
    mesh = grads[flat[0]].device_mesh
    locals_ = {i: slice_onto_shards(grads[i], targets[i]).to_local() for i in flat}
    for m in range(mesh.ndim):
        members = [i for i in flat if grads[i].placements[m].is_partial() and targets[i][m].is_shard()]
        if members:
            with tags.reason("", f"{why} (one reduce-scatter over {mesh.mesh_dim_names[m]})"):
                dims = [targets[i][m].dim for i in members]
                pending = collectives.reduce_scatter([locals_[i] for i in members], dims, mesh, m, wire)
                locals_.update(zip(members, pending.results()))
    summed: dict = {}  # the mesh dims a gradient is still summed over (partial, not scattered) -> its members
    for i in flat:
        dims = tuple(
            m for m, (pl, t) in enumerate(zip(grads[i].placements, targets[i])) if pl.is_partial() and not t.is_shard()
        )
        if dims:
            summed.setdefault(dims, []).append(i)
    for dims, members in summed.items():
        with tags.reason("", f"{why} (one all-reduce over {'+'.join(mesh.mesh_dim_names[m] for m in dims)})"):
            pending = collectives.all_reduce([locals_[i] for i in members], mesh, dims, wire)
            locals_.update(zip(members, pending.results()))
    for i in flat:
        out[i] = wrap_local(locals_[i], mesh, targets[i], grads[i].shape, grads[i].stride())
    return out


def reduce_grads(params: list, targets: list, dtype, phase: str, why: str, wire=None) -> None:
    """Each `p.grad` reduced to its target layout (`reduce_all_to`) in `dtype` (None: its own), then back in p's."""
    grads = [p.grad if dtype is None else p.grad.to(dtype) for p in params]
    with tags.phase(phase):
        reduced = reduce_all_to(grads, targets, why, wire)
    for p, g in zip(params, reduced):
        p.grad = g.to(p.dtype)


def _bucketable(g: DTensor, target) -> bool:
    dims = [t.dim for t in target if t.is_shard()]
    return (
        len(dims) == len(set(dims))
        and all(not p.is_partial() or p.reduce_op == "sum" for p in g.placements)
        and all(p == t or p.is_partial() or (p.is_replicate() and t.is_shard()) for p, t in zip(g.placements, target))
    )
