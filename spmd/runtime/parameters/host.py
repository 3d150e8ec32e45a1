"""`parallelize(offload="params")`: parameter shards live in host memory between uses (ZeRO-3 with offload).

A shard is copied to the device in the compute dtype before its gather, and its reduced gradient copied back to
the host, where the optimizer steps. On a CPU-only machine both copies are still real, so gathers never read the
stored shard and a gradient never stays in the tensor the reduction wrote.
"""

import torch

__all__ = ["PARAMS", "host_params", "compute_device", "host_tensor"]

PARAMS = "params"


def host_params(state) -> bool:
    return state is not None and state.offload == PARAMS


def compute_device(mesh) -> torch.device:
    """The device this rank computes on: the mesh's, at the current CUDA device when it is CUDA."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def host_tensor(local: torch.Tensor) -> torch.Tensor:
    """A host copy of `local`, pinned when there is a CUDA device (copies to and from it can then overlap)."""
    out = local.to("cpu", copy=True)
    return out.pin_memory() if torch.cuda.is_available() else out
