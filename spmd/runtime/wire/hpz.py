"""ZeRO++'s hpZ: a secondary copy of a parameter's shards, kept from forward to backward, sharded only over
the `comm["hpz"]` mesh axis (inside a node), so backward's regather stays inside it. A parameter qualifies when
its storage shards it over that axis and over another its compute layout replicates (`embed -> (dp, fsdp)`):
forward gathers over the whole group, keeps the slice the hpz axis alone would give this rank (a local copy),
and backward all-gathers that over the hpz axis; numel / hpz size elements each meanwhile (`secondary_bytes`).
"""

import torch
from torch.distributed.tensor import DTensor

from .. import tags
from ..dtensor.wrap import local_of, wrap_local

__all__ = ["secondary_placements", "keep_secondary", "regather_secondary", "secondary_bytes"]


def secondary_placements(p: DTensor, compute, hpz: str) -> tuple | None:
    """The secondary copy's layout: the storage's shard over the hpz axis, the compute layout elsewhere;
    None when the parameter does not qualify (nothing over another axis to save)."""
    mesh = p.device_mesh
    if hpz not in (mesh.mesh_dim_names or ()):
        return None
    h = mesh.mesh_dim_names.index(hpz)
    storage = tuple(p.placements)
    if mesh.size(h) == 1 or not (storage[h].is_shard() and compute[h].is_replicate()):
        return None
    if not any(s != c and mesh.size(m) > 1 for m, (s, c) in enumerate(zip(storage, compute)) if m != h):
        return None
    return tuple(storage[m] if m == h else compute[m] for m in range(mesh.ndim))


@torch.no_grad()
def keep_secondary(g: DTensor, p: DTensor, compute, wire) -> DTensor | None:
    """The secondary copy of `p` cut from its gathered value `g` (its own storage: `g` may be freed)."""
    placements = None if wire is None or wire.hpz is None else secondary_placements(p, compute, wire.hpz)
    if placements is None:
        return None
    cut = g.detach().redistribute(placements=placements)  # replicate -> shard: a local slice
    return wrap_local(local_of(cut).clone(), g.device_mesh, placements, g.shape, g.stride())


def regather_secondary(secondary: DTensor, compute, module: str, name: str) -> DTensor:
    with tags.reason(module, f"regather {name} for backward from its hpZ secondary shard"):
        return secondary.redistribute(placements=tuple(compute))


def secondary_bytes(model, state) -> int:
    """Bytes per rank of the secondary copies a step keeps from forward to backward (all at once: the last
    module's backward needs its copy after every forward has run)."""
    total = 0
    for p in model.parameters():  # (each once, shared ones too)
        if isinstance(p, DTensor) and secondary_placements(p, p._spmd_compute, state.wire.hpz) is not None:
            size = p.device_mesh.size(p.device_mesh.mesh_dim_names.index(state.wire.hpz))
            dtype = state.param_dtype or p.dtype
            total += p.numel() // size * dtype.itemsize
    return total
