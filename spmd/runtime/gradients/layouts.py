"""How a gradient reaches the layout the grads map gives it (its parameter's storage layout unless a ZeRO
stage holds gradients sharded beyond their parameters): the free slicing first, then the reductions, and
the gradient held back under no_sync joining the next one. Under ZeRO-1 (`held_for_step`) backward leaves
the partial sums on the axes the grads map replicates unreduced, as no_sync does, and the step
reduce-scatters them into the optimizer's shards."""

from torch.distributed.tensor import DTensor

from .. import tags

__all__ = [
    "grads_layout",
    "reduce_to",
    "slice_onto_shards",
    "join_unreduced",
    "held_for_step",
    "HELD_ATTR",
    "optim_layout",
    "reduce_gradient",
    "summed_as_eager",
]

HELD_ATTR = "_spmd_reduce_at_step"  # set by shard_optimizer on a parameter its step reduces (ZeRO-1)


def held_for_step(p) -> bool:
    """Whether backward leaves `p`'s gradient unreduced for the optimizer step to reduce-scatter."""
    return getattr(p, HELD_ATTR, False)


def grads_layout(p) -> tuple:
    """The placements `p`'s reduced gradient is held in (the grads map's; the storage layout by default)."""
    return tuple(getattr(p, "_spmd_grads", None) or p.placements)


def reduce_gradient(g: DTensor, grads, held: bool, unreduced: bool, p=None, where: tuple | None = None) -> DTensor:
    """One gradient, in the reduce dtype, in the layout backward leaves: unreduced while accumulating; `held` for a
    ZeRO-1 step (partial sums kept on the axes it replicates); else `grads`. `p`: its eager parameter, whose held
    no_sync gradient joins it once. `where`: the (module, parameter) tag; None in a compiled graph."""
    if unreduced and (p is not None or not held):
        return g
    if held:
        if p is not None and p.grad is not None and tuple(p.grad.placements) == tuple(g.placements):
            g = g + p.grad.to(g.dtype)
            p.grad = None
        # ZeRO-1 leaves it on the grads map's shards, partial sums (or what it holds) on the axes that map replicates
        target = tuple(s if s.is_shard() else c for c, s in zip(g.placements, grads))
        why = "but over the axes its step shards"
    else:
        g = g if p is None else join_unreduced(p, g)
        target, why = tuple(grads), "to its storage layout"
    if tuple(g.placements) == target:  # (reduce_to would too, after slicing and tagging: every step, per parameter)
        return g
    if where is None:
        return reduce_to(g, target)
    with tags.reason(where[0], f"reduce gradient of {where[1]} {why}"):
        return reduce_to(g, target)


def optim_layout(p) -> tuple:
    """The placements `p`'s optimizer states and master live in (the optimizer map's; else its storage layout)."""
    return tuple(getattr(p, "_spmd_optim", None) or p.placements)


def reduce_to(g: DTensor, storage) -> DTensor:
    """Redistributes a gradient to `storage` moving fewest bytes: slice, then reduce-scatter, then all-reduce."""
    g = slice_onto_shards(g, storage)
    step = tuple(s if c.is_partial() and s.is_shard() else c for c, s in zip(g.placements, storage))
    if step != tuple(g.placements):
        g = g.redistribute(g.device_mesh, step)
    if tuple(g.placements) != tuple(storage):
        g = g.redistribute(g.device_mesh, storage)
    return g


def slice_onto_shards(g: DTensor, storage) -> DTensor:
    """`g` with its replicated dims that `storage` shards sliced locally (free: no communication)."""
    step = tuple(s if c.is_replicate() and s.is_shard() else c for c, s in zip(g.placements, storage))
    return g.redistribute(g.device_mesh, step) if step != tuple(g.placements) else g


def join_unreduced(p, g: DTensor) -> DTensor:
    """`g` plus the gradient `p` accumulated under no_sync (then taken off `p.grad`): reduced together, once."""
    if p.grad is not None and tuple(p.grad.placements) != grads_layout(p):
        g = g + p.grad.to(g.dtype)
        p.grad = None
    return g


def summed_as_eager(params: list, grads: list, token_axes: tuple, where: str) -> list:
    """A compiled block's gradients in eager's layouts (partial only over the token axes replicating the parameter):
    what a compiled backward leaves partial over tp is summed here in full precision, before any wire."""
    out = []
    for p, g in zip(params, grads):
        if isinstance(g, DTensor):
            target = tuple(
                c if not c.is_partial() or (name in token_axes and compute.is_replicate()) else compute
                for c, compute, name in zip(g.placements, p._spmd_compute, g.device_mesh.mesh_dim_names or ())
            )
            if target != tuple(g.placements):
                with tags.reason(where, f"sum gradient of {p._spmd_name} over the axes eager's backward sums it"):
                    g = g.redistribute(g.device_mesh, target)
        out.append(g)
    return out
