"""`detach` of a DTensor is the same layout around its local tensor's detach.

AccumulateGrad detaches every gradient it stores, and DTensor spends longer propagating a detach's layout than
the detach takes: this op handler answers with the input's spec directly. A traced detach keeps DTensor's own.
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
    DTensor._op_dispatcher._custom_op_handlers.setdefault(torch.ops.aten.detach.default, _detach)
