"""One parameter's gather in a quantized wire format: the per-parameter path's unshard, routed through the
flat all-gather (spmd.runtime.collectives) rather than DTensor's redistribute, which knows no wire format."""

from torch.distributed.tensor import DTensor

from .. import collectives
from ..dtensor.wrap import local_of, wrap_local
from .quantize import BLOCKWISE

__all__ = ["gather_on_wire"]


def gather_on_wire(x: DTensor, placements: tuple, dims: dict | None, wire) -> DTensor | None:
    """`x` in `placements` through the quantized flat all-gather, or None when the move is not only un-sharding
    even shards (`dims`, parameters.group.shard_dims: one mesh axis per tensor dim), or nothing travels quantized."""
    mesh = x.device_mesh
    if wire is None or wire.params not in BLOCKWISE:  # float8 weights travel in float8 in flat groups only
        return None
    if not dims or any(x.shape[d] % mesh.size(m) for m, d in dims.items()):
        return None
    whole = collectives.all_gather_dims(local_of(x), dims, mesh, wire)
    return wrap_local(whole, mesh, tuple(placements), x.shape, x.stride())
