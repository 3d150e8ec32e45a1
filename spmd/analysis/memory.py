"""Memory per rank of a laid-out model: parameters, gradients and optimizer states from the local shards."""
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["local_bytes", "memory_per_rank", "OPTIMIZER_STATES"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # states per parameter element


def local_bytes(t) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def memory_per_rank(model: nn.Module, optimizer: str, activations: int = 0) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states, from the local shards."""
    params = sum(local_bytes(p) for p in model.parameters())
    mem = {"parameters": params, "gradients": params, "optimizer": OPTIMIZER_STATES[optimizer] * params,
           "activations": activations}
    mem["total"] = sum(mem.values())
    return mem
