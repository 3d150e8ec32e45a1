"""How a gradient reaches the layout the grads map gives it (its parameter's storage layout unless a ZeRO
stage holds gradients sharded beyond their parameters): the free slicing first, then the reductions, and
the gradient held back under no_sync joining the next one."""
from torch.distributed.tensor import DTensor

__all__ = ["grads_layout", "reduce_to", "slice_onto_shards", "join_unreduced"]


def grads_layout(p) -> tuple:
    """The placements `p`'s reduced gradient is held in (the grads map's; the storage layout by default)."""
    return tuple(getattr(p, "_spmd_grads", None) or p.placements)


def reduce_to(g: DTensor, storage) -> DTensor:
    """Redistributes a gradient to `storage` in the order that moves fewest bytes: slice replicated dims
    (free), then reduce-scatter partial sums onto sharded dims, then all-reduce what stays replicated
    (HSDP all-reduces the fsdp shard over dp, not the whole gradient)."""
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
    """`g` plus the gradient `p` accumulated unreduced under no_sync, which then leaves `p.grad`: both are
    reduced together, once."""
    if p.grad is not None and tuple(p.grad.placements) != grads_layout(p):
        g = g + p.grad.to(g.dtype)
        p.grad = None
    return g
