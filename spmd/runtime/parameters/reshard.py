"""ZeRO-3's reshard-after-forward: a gathered parameter is not kept alive for backward.

While a module runs forward, tensors autograd saves that alias a gathered parameter are replaced by a
small handle; backward regathers the parameter from its shard when it needs it. Modules under activation
checkpointing skip this: recomputation regathers anyway.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor

from .. import collectives
from ..activations import attention_memory
from ..dtensor.wrap import local_of

__all__ = [
    "CHECKPOINTED_ATTR",
    "BODY_COMPILED_ATTR",
    "gathers_in_graph",
    "reshard_after_forward",
    "storage_key",
    "observe_saved",
]

CHECKPOINTED_ATTR = "_spmd_checkpointed"
BODY_COMPILED_ATTR = "_spmd_body_compiled"  # a block whose hooks run eager around its compiled body or forward


def gathers_in_graph(block, wire=None) -> bool:
    """Whether `block` gathers its parameters inside a compiled graph (compiled whole, or a checkpointed block's
    compiled body off the quantized `wire`), where nothing would take a prefetched bucket. On the wire a
    compiled body's group gathers in the block's hooks and again before its recompute."""
    return getattr(block, "_compiled_call_impl", None) is not None or (
        getattr(block, BODY_COMPILED_ATTR, False) and getattr(block, CHECKPOINTED_ATTR, False) and wire is None
    )


_observers: list[dict] = []


def storage_key(t: torch.Tensor) -> int:
    """The storage a tensor (a DTensor: its local tensor) views: tensors aliasing one storage share the key."""
    return local_of(t).untyped_storage()._cdata


class _Regather:
    __slots__ = ("hit", "module", "local_view", "spec", "state")

    def __init__(self, hit: tuple, module, t: torch.Tensor, state):
        self.hit, self.module, self.state = hit, module, state  # (param, compute, group, hpZ secondary or None)
        local = local_of(t)
        self.local_view = (local.size(), local.stride(), local.storage_offset())
        # a plain tensor is a view of the gathered local shard (experts compute on local tensors)
        self.spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None

    def materialize(self) -> DTensor:
        # a flat group's whole block, gathered once for its backward; a group of one's parameter alone
        p, compute, group, secondary = self.hit
        full = group.regather(self.state.param_dtype, self.state, compute, self.module, secondary)[id(p)]
        size, stride, offset = self.local_view
        local = collectives.wait(local_of(full)).as_strided(size, stride, offset)
        if self.spec is None:
            return local
        mesh, placements, shape, gstride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=gstride)


def reshard_after_forward(gathered: dict, state, module: str):
    """saved_tensors_hooks that swap tensors aliasing `gathered` ({storage key: (param, compute, its group, its hpZ
    secondary shard or None)}): the group regathers it in backward (spmd.runtime.parameters.group)."""

    def pack(t):
        hit = gathered.get(storage_key(t))
        if hit is not None:
            return _Regather(hit, module, t, state)
        _observe(t)
        return t

    def unpack(x):
        return x.materialize() if isinstance(x, _Regather) else x

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _observe(t):
    if _observers:
        storage = local_of(t).untyped_storage()
        for seen in _observers:
            seen[storage._cdata] = storage.nbytes()
        attention_memory.note_saved(storage._cdata, storage.nbytes())


@contextlib.contextmanager
def observe_saved(seen: dict):
    """Collects {storage: bytes} of every tensor autograd saves (local shards): the activation memory."""
    _observers.append(seen)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (_observe(t), t)[1], lambda t: t):
            yield seen
    finally:
        _observers.remove(seen)
