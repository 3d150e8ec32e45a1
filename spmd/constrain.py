"""`constrain(x, *axes)`: an activation layout constraint (JAX's with_sharding_constraint).

The identity on a plain tensor, so model code runs unchanged on one device; inside a parallelized model
the activation moves to the layout the rules give these logical axes, as a planned, recorded move.
"""
import torch
from torch.distributed.tensor import DTensor

from . import record
from .moves import move
from .rules import placements_for


def constrain(x: torch.Tensor, *axes) -> torch.Tensor:
    if len(axes) != x.dim():
        raise ValueError(f"constrain got {len(axes)} axes {axes} for a tensor with {x.dim()} dims "
                         f"(shape {tuple(x.shape)}); give one logical name or None per dim")
    if not isinstance(x, DTensor):
        return x
    from .parallelize import active_state
    state = active_state()
    if state is None:
        return x
    where = f"constrain{axes}"
    dims = state.rules.mesh_axes(axes, "compute", where, strict=False)
    target = placements_for(x.device_mesh, dims, x.shape, f"activation {where} in {record.current_module()!r}")
    return move(x, target, record.current_module(), f"constrain{tuple(axes)}")
