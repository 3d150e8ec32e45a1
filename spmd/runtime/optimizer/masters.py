"""After an optimizer step on masters (spmd.shard_optimizer): the updated shards all-gathered into their
parameters' storage layout (the phase `optimizer` of the plan). Masters sharded over one more mesh dim than
their parameter gather in flat buffers of up to the gradient buckets' size (spmd.runtime.collectives), one
collective per buffer; the others one by one. Masters in host memory (offloaded) cross to the device on the
side stream (spmd.runtime.optimizer.transfer), each buffer's copies during the all-gather of the one before."""

import torch

from .. import collectives, tags
from ..dtensor.wrap import local_of, wrap_local
from ..gradients.reducer import DEFAULT_BUCKET_MB
from .transfer import SideStream, side_stream

__all__ = ["MASTER_OF_ATTR", "gather_updated", "gather_into_param"]

MASTER_OF_ATTR = "_spmd_master_of"  # on a master: the model parameter it stands for


@torch.no_grad()
def gather_updated(opt: torch.optim.Optimizer) -> None:
    """The masters' updated shards into their parameters' storage layout (run after each step)."""
    masters = [m for g in opt.param_groups for m in g["params"] if hasattr(m, MASTER_OF_ATTR)]
    gathered: dict = {}  # (mesh, mesh dim, dtype) -> [(master, tensor dim)]
    with tags.phase("optimizer"):
        for master in masters:
            p = getattr(master, MASTER_OF_ATTR)
            dims = _gathered_dims(master, p)
            if dims is None:
                gather_into_param(master)
            else:
                gathered.setdefault((id(p.device_mesh), dims[0], p.dtype), []).append((master, dims[1]))
        work = [
            (bucket, mesh_dim)
            for (_, mesh_dim, _), members in gathered.items()
            for bucket in _capped(members, GATHER_BUCKET_BYTES)
        ]
        ahead = _to_param_device([m for m, _ in work[0][0]]) if work else None
        for k, (bucket, mesh_dim) in enumerate(work):  # a buffer's copies travel during the all-gather before
            arrived, ahead = ahead, (_to_param_device([m for m, _ in work[k + 1][0]]) if k + 1 < len(work) else None)
            _gather_bucket(bucket, mesh_dim, arrived)


GATHER_BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2**20)  # gathered bytes per buffer: a bounded transient


def _gathered_dims(master, p):
    """(mesh dim, tensor dim) when `master` (on `p`'s mesh) is `p`'s layout split over one more mesh dim, else None."""
    differ = [i for i, (a, b) in enumerate(zip(master.placements, p.placements)) if a != b]
    if len(differ) != 1 or not master.placements[differ[0]].is_shard() or not p.placements[differ[0]].is_replicate():
        return None
    dim = master.placements[differ[0]].dim
    if any(pl.is_shard(dim) for pl in p.placements):  # the dim is also split over another mesh dim
        return None
    return differ[0], dim


def _capped(members: list, cap: int) -> list:
    """`members` cut in order into runs of at most `cap` parameter bytes (a larger one alone)."""
    runs, size = [[]], 0
    for master, dim in members:
        nbytes = local_of(getattr(master, MASTER_OF_ATTR)).nbytes
        if runs[-1] and size + nbytes > cap:
            runs.append([])
            size = 0
        runs[-1].append((master, dim))
        size += nbytes
    return runs


def _to_param_device(masters) -> tuple:
    """(the masters' shards on their parameters' device and dtype, the event their side-stream copies end with)."""
    out, event = [], None
    for m in masters:
        p, local = getattr(m, MASTER_OF_ATTR), local_of(m)
        if local.device == p.device:
            out.append(local.to(p.dtype))
        else:
            out.append(torch.empty(local.shape, dtype=p.dtype, device=p.device))
            event = side_stream(p.device).copy(out[-1], local)
    return out, event


def _gather_bucket(bucket: list, mesh_dim: int, arrived: tuple) -> None:
    """One flat all-gather over `mesh_dim` of `bucket`'s updated shards, `arrived` on the device."""
    params = [getattr(m, MASTER_OF_ATTR) for m, _ in bucket]
    shards, event = arrived
    SideStream.device_wait(event)
    with tags.reason("", f"all-gather updated {len(bucket)} parameters to their params layout (one buffer)"):
        full = collectives.all_gather(
            shards, [d for _, d in bucket], [local_of(p).shape for p in params], params[0].device_mesh, mesh_dim
        )
    for p, f in zip(params, full):
        local_of(p).copy_(f)


def gather_into_param(master) -> None:
    p = getattr(master, MASTER_OF_ATTR)
    (local,), event = _to_param_device([master])
    SideStream.device_wait(event)
    m = wrap_local(local, p.device_mesh, master.placements, master.shape, master.stride())
    with tags.reason("", f"all-gather updated {p._spmd_name} to its params layout"):
        full = m.redistribute(p.device_mesh, p.placements)
    local_of(p).copy_(full.to_local())
