"""`detach` of a DTensor is the same layout around its local tensor's detach.

Autograd detaches every gradient it stores into a parameter's `.grad` (AccumulateGrad), one per parameter
per step, and DTensor's dispatch spends longer propagating the layout of a detach than the detach itself
takes. This DTensor op handler (torch's mechanism for ops it treats specially, as fused_step's) gives the
answer directly: the input's spec, shared as DTensor's cached output specs are. A traced detach (under
torch.compile) keeps DTensor's own dispatch. `spmd.runtime.dtensor.install` registers it.
"""

import torch
from torch.distributed.tensor import DTensor

from .fused_step import dtensor_dispatch

__all__ = ["install"]


def _detach(op_call, args, kwargs):
    x = args[0]
    if type(x._local_tensor) is not torch.Tensor:  # traced (fake, functional) or another subclass: DTensor's
        return dtensor_dispatch(op_call, args, kwargs)  # own dispatch (the compiler's partitioner needs its graph)
    return DTensor.__new__(DTensor, x._local_tensor.detach(), x._spec, requires_grad=False)


def install() -> None:
    """Registers the handler for aten.detach (idempotent)."""
    DTensor._op_dispatcher._custom_op_handlers.setdefault(torch.ops.aten.detach.default, _detach)
