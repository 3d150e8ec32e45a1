"""One parameter's gather in a quantized wire format: the per-parameter path's unshard, routed through the
flat all-gather (spmd.runtime.collectives) rather than DTensor's redistribute, which knows no wire format."""

from torch.distributed.tensor import DTensor

from .. import collectives
from ..dtensor.wrap import local_of, wrap_local
from .quantize import BLOCKWISE

__all__ = ["gather_on_wire"]


def gather_on_wire(x: DTensor, placements: tuple, wire) -> DTensor | None:
    """`x` in `placements` through the quantized flat all-gather, or None when the move is not only
    un-sharding even shards (one mesh axis per tensor dim), or nothing travels quantized."""
    mesh = x.device_mesh
    if wire is None or wire.params not in BLOCKWISE:  # float8 weights travel in float8 in flat groups only
        return None
    dims, seen = {}, set()
    for m, (s, c) in enumerate(zip(x.placements, placements)):
        if mesh.size(m) == 1 or s == c:
            if s.is_shard() and mesh.size(m) > 1:
                seen.add(s.dim)
            continue
        if not (s.is_shard() and c.is_replicate()) or s.dim in seen or x.shape[s.dim] % mesh.size(m):
            return None
        dims[m] = s.dim
        seen.add(s.dim)
    if not dims:
        return None
    whole = collectives.all_gather_dims(local_of(x), dims, mesh, wire)
    return wrap_local(whole, mesh, tuple(placements), x.shape, x.stride())
