"""Memory per rank of a laid-out model: parameters, gradients and optimizer states from the local shards, and
the activations: the storages autograd keeps for backward that are not the model's own."""
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..layout.annotate import get_axes
from ..runtime.experts import EXPERTS

__all__ = ["activation_bytes", "local_bytes", "memory_per_rank", "OPTIMIZER_STATES"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # states per parameter element


def storage_key(t) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.untyped_storage()._cdata


def activation_bytes(saved: dict, model: nn.Module) -> int:
    """Bytes of the storages autograd saved ({storage: bytes}, see runtime.reshard.observe_saved), less the
    model's own parameters and buffers: a weight or a RoPE table that autograd saves is held anyway (counted
    under parameters), so it costs no activation memory."""
    own = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    return sum(n for key, n in saved.items() if key not in own)


def local_bytes(t) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def memory_per_rank(model: nn.Module, optimizer: str, activations: int = 0) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states, from the local shards."""
    params = sum(local_bytes(p) for p in model.parameters())
    mem = {"parameters": params, "gradients": params, "optimizer": OPTIMIZER_STATES[optimizer] * params,
           "activations": activations}
    mem["total"] = sum(mem.values())
    experts = sum(local_bytes(p) for p in model.parameters() if EXPERTS in (get_axes(p) or ()))
    if experts:  # part of `parameters`: the stacked experts this rank holds (E/ep of them under ep)
        mem["expert_parameters"] = experts
    return mem
