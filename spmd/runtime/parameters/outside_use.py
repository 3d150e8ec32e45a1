"""Parameters a model uses outside their own module's forward: a tied head `F.linear(x, self.wte.weight)`.

Read from another module the attribute is the parameter in storage layout; while the model runs forward the
matrix functions below get its compute-layout gather instead (backward reducing into storage), and `F.linear`
first moves its input to that weight's layout, as a linear layer's hook does.
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from .. import tags
from ..activations.moves import move_linear_input
from .gather import gather_shared

__all__ = ["FUNCS", "stored", "call"]

FUNCS = {
    F.linear,
    F.embedding,
    torch.matmul,
    torch.mm,
    torch.addmm,
    torch.bmm,
    torch.einsum,
    torch.Tensor.__matmul__,
    torch.Tensor.matmul,
}


def stored(t) -> bool:
    """A parameter laid out by spmd, as stored (not a gathered copy)."""
    return isinstance(t, torch.nn.Parameter) and isinstance(t, DTensor) and hasattr(t, "_spmd_compute")


def call(state, func, args, kwargs):
    """`func(*args, **kwargs)` with each stored parameter in its compute layout (and F.linear's input moved)."""
    name = tags.current_module()
    weight, w_override = None, None
    if func is F.linear and len(args) > 1 and stored(args[1]) and isinstance(args[0], DTensor):
        weight = args[1]
        x, w_override = move_linear_input(state, name, weight, args[0])
        args = (x,) + tuple(args[1:])

    def gathered(t):
        if not stored(t):
            return t
        compute = w_override if (w_override is not None and t is weight) else t._spmd_compute
        return gather_shared(state, t, compute, name)

    return func(*tree_map(gathered, args), **tree_map(gathered, kwargs))
