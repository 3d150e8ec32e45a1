"""Plain tensors a model makes while it runs (positions, masks, `arange`, constants) are replicated.

A model on the global view makes such tensors from global shapes, so every rank holds the same whole
tensor: exactly a replicated DTensor. While a parallelized model runs forward (and while a checkpointed
block recomputes in backward), a torch-function mode turns every plain tensor that meets a DTensor in an
op into a replicated DTensor before the op runs. Autograd then saves DTensors, so the backward never mixes
the two either. The same mode hands parameters used outside their own module their compute layout
(spmd.runtime.direct). Code outside the model keeps DTensor's strict mixing check.
"""
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from . import direct

__all__ = ["GlobalView"]


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.numel() != 1


class GlobalView(TorchFunctionMode):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        mesh = next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
        if mesh is not None and any(_plain(a) for a in flat):
            def replicate(t):
                return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False) if _plain(t) else t
            args, kwargs = tree_map(replicate, args), tree_map(replicate, kwargs)
            flat, _ = tree_flatten((args, kwargs))
        if func in direct.FUNCS and any(direct.stored(a) for a in flat):
            return direct.call(self.state, func, args, kwargs)
        return func(*args, **kwargs)
