"""Parameters and buffers in their storage layout: each rank's slice of its initial value, from the tensor itself
or, for a model built on the meta device, from `param_init`, one full tensor at a time."""

import torch
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor

from ...layout.annotate import copy_annotations, get_pin
from ...layout.rules import placements_for
from ..dtensor.wrap import local_of, wrap_local
from .host import host_params, host_tensor

__all__ = ["check_param_init", "laid_out_param", "laid_out_buffer"]


def check_param_init(model: nn.Module, param_init) -> None:
    """Refuses a model with meta tensors and no `param_init`, before anything is laid out."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if param_init is None and meta:
        raise ValueError(
            f"{meta[0]!r} is on the meta device; pass parallelize(..., param_init=fn) with fn(name, tensor) "
            f"returning its initial value (e.g. the model's initializer()), or build the model on a device"
        )


def laid_out_param(p, name: str, layout, state, param_init) -> nn.Parameter:
    """`p` as a DTensor parameter in its storage layout and dtype, carrying its other layouts and its name."""
    storage, compute, grads, optim = layout
    value = _initial_value(p, name, param_init)
    if state.master == "optimizer" and state.param_dtype is not None and value.dtype.is_floating_point:
        value = value.to(state.param_dtype)  # the fp32 master lives with the optimizer
    dt = distribute_tensor(value, state.mesh, storage, src_data_rank=None)
    if host_params(state):
        dt = wrap_local(host_tensor(local_of(dt)), state.mesh, storage, dt.shape, dt.stride())
    new = nn.Parameter(dt, requires_grad=p.requires_grad)
    copy_annotations(p, new)
    new._spmd_compute, new._spmd_grads, new._spmd_optim = compute, grads, optim
    new._spmd_name = name
    return new


def laid_out_buffer(b: torch.Tensor, name: str, state, param_init):
    """A buffer as a DTensor in its pinned layout, or the compute layout its axes take."""
    placements = get_pin(b) or placements_for(
        state.mesh,
        state.rules.mesh_axes(getattr(b, "_spmd_axes", None) or (None,) * b.dim(), "compute", f"buffer {name!r}"),
        b.shape,
        f"buffer {name!r}",
    )
    return distribute_tensor(_initial_value(b, name, param_init), state.mesh, placements, src_data_rank=None)


def _initial_value(t: torch.Tensor, name: str, param_init) -> torch.Tensor:
    if not t.is_meta:
        return t.data  # (a meta tensor has a param_init: check_param_init refused the model otherwise)
    with torch.no_grad():
        value = param_init(name, t)
    if tuple(value.shape) != tuple(t.shape) or value.is_meta:
        raise ValueError(
            f"param_init({name!r}) returned {'a meta tensor' if value.is_meta else tuple(value.shape)}; "
            f"expected a real tensor of shape {tuple(t.shape)}"
        )
    return value.to(t.dtype)
