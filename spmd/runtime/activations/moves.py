"""How activations move: the layout decisions of the propagation pass and the moves that carry them out.

DTensor's op rules carry layouts through most ops; the pass changes them in explicit, recorded moves at `constrain`
points and at linear layers, whose input must fit the weight (when both shard one mesh axis on different dims,
the smaller is gathered). `move`'s backward brings the gradient back to the source's layout.
"""

import math
from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...layout.rules import placements_for
from .. import tags
from ..local.edges import map_tensors, to_local
from ..state import active_state, tracing

__all__ = [
    "Decision",
    "constrain",
    "move",
    "grad_layout",
    "linear_layouts",
    "move_linear_input",
    "finish_output",
    "map_tensors",
]


@dataclass
class Decision:
    module: str
    mesh_axis: str
    choice: str  # "gather activation" | "gather weight"
    activation_bytes: int  # per rank, all-gather of the activation over mesh_axis
    weight_bytes: int  # per rank, all-gather of the weight over mesh_axis
    why: str = ""

    def to_dict(self):
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.module}: {self.choice} over {self.mesh_axis} "
            f"(activation {self.activation_bytes:,} B vs weight {self.weight_bytes:,} B per rank: {self.why})"
        )


def gathered_bytes(shape, placements, mesh, dim: int, element_size: int) -> int:
    """Per-rank bytes an all-gather over mesh dim `dim` moves: the local size after it, times (n-1)/n."""
    numel = math.prod(shape)
    for i, p in enumerate(placements):
        if i != dim and p.is_shard():
            numel //= mesh.size(i)
    n = mesh.size(dim)
    return numel * element_size * (n - 1) // n


def linear_layouts(x: DTensor, w_shape, w_placements, w_element_size: int, module: str):
    """For `F.linear(x, w)` (w: [out, in]): the input layout to move to, the weight layout to use, any decisions."""
    mesh = x.device_mesh
    last = x.ndim - 1
    x_target = list(x.placements)
    w_target = list(w_placements)
    decisions = []
    for m, (xp, wp) in enumerate(zip(x.placements, w_placements)):
        axis = mesh.mesh_dim_names[m]
        if mesh.size(m) == 1 or axis == "cp":
            continue  # cp splits only tokens, which a linear layer takes one by one
        if xp.is_partial():
            # a partial sum cannot meet a bias or a sharded weight: summed here into the layout the weight wants
            x_target[m] = Shard(last) if wp == Shard(1) else Replicate()
            continue
        x_sharded_elsewhere = xp.is_shard() and xp.dim != last
        if wp == Shard(0) and xp.is_shard() or wp == Shard(1) and x_sharded_elsewhere:
            act = gathered_bytes(x.shape, x.placements, mesh, m, x.element_size()) if xp.is_shard() else 0
            wb = gathered_bytes(w_shape, w_placements, mesh, m, w_element_size)
            # gathering the weight keeps the layer data-parallel: sound for a batch split only (attention
            # downstream needs the whole sequence)
            if x_sharded_elsewhere and xp.dim == 0 and wb < act:
                w_target[m] = Replicate()
                decisions.append(Decision(module, axis, "gather weight", act, wb, "fewer bytes"))
            else:
                x_target[m] = Shard(last) if wp == Shard(1) else Replicate()
                why = (
                    (
                        "fewer bytes"
                        if act <= wb
                        else "the input is split along a non-batch dim (sequence) that later ops need whole"
                    )
                    if x_sharded_elsewhere
                    else "the input is split along its features"
                )
                decisions.append(Decision(module, axis, "gather activation", act, wb, why))
        elif wp == Shard(1) and not xp.is_shard():
            x_target[m] = Shard(last)  # a local slice, no communication
        elif wp.is_replicate() and xp.is_shard() and xp.dim != 0:
            # split along features, or the sequence that attention after a whole (fused qkv) weight needs whole
            x_target[m] = Replicate()
    return tuple(x_target), tuple(w_target), decisions


def grad_layout(placements):
    return tuple(Replicate() if p.is_partial() else p for p in placements)


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, placements, grad_placements, module, why):
        ctx.src = grad_layout(x.placements) if grad_placements is None else tuple(grad_placements)
        ctx.module, ctx.why = module, why
        if tuple(x.placements) == tuple(placements):
            return x.view_as(x)
        with tags.reason(module, why):
            return x.redistribute(placements=placements)

    @staticmethod
    def backward(ctx, g: DTensor):
        if tuple(g.placements) != ctx.src:
            with tags.reason(ctx.module, f"backward of {ctx.why}"):
                g = g.redistribute(g.device_mesh, ctx.src)
        return g, None, None, None, None


def move(x: DTensor, placements, module: str, why: str, grad_placements=None) -> DTensor:
    """Redistributes `x` to `placements`. `grad_placements` overrides the gradient's layout on the way back."""
    placements = tuple(placements)
    compiling = tracing()
    if tuple(x.placements) == placements and (grad_placements is None or compiling or not x.requires_grad):
        return x
    if compiling or not x.requires_grad:
        # no gradient to lay out; or the compiler's, where DTensor's redistribute traces to functional collectives,
        # its backward's layout being _Move's
        with tags.reason(module, why):
            return x.redistribute(placements=placements)
    return _Move.apply(x, placements, grad_placements, module, why)


def move_linear_input(state, name, w, x, transposed: bool = False):
    """(x moved to the layout `w` needs, the weight's layout if not its compute one); `transposed`: w is [in, out]."""
    el = torch.finfo(state.param_dtype).bits // 8 if state.param_dtype else w.element_size()
    compute = _transpose(w._spmd_compute) if transposed else tuple(w._spmd_compute)
    shape = tuple(reversed(w.shape)) if transposed else tuple(w.shape)
    compiling = tracing()
    x_target, w_target, decisions = linear_layouts(x, shape, compute, el, "" if compiling else name)
    if compiling:  # no bookkeeping: a graph serves every module of a type, and the compiler merges repeated moves
        moved = _move_input(x, x_target, name)
    else:
        for d in decisions:
            state.decisions[(name, d.mesh_axis)] = d
        key = (id(x), x_target)
        if key not in state.move_cache:
            state.move_cache[key] = (x, _move_input(x, x_target, name))
        moved = state.move_cache[key][1]
    if w_target == compute:
        return moved, None
    return moved, (_transpose(w_target) if transposed else w_target)


def _move_input(x, target, name: str):
    return move(x, target, name, "move input to the layout its weight needs", grad_placements=grad_layout(x.placements))


def _transpose(placements) -> tuple:
    return tuple(Shard(1 - p.dim) if p.is_shard() else p for p in placements)


def constrain(x: torch.Tensor, *axes) -> torch.Tensor:
    if tracing() or not isinstance(x, DTensor):
        return _constrain(x, axes)
    with torch._C.DisableTorchFunction():  # the global view has nothing to do here; under it each op costs twice
        return _constrain(x, axes)


def _constrain(x: torch.Tensor, axes) -> torch.Tensor:
    if len(axes) != x.dim():
        raise ValueError(
            f"constrain got {len(axes)} axes {axes} for a tensor with {x.dim()} dims "
            f"(shape {tuple(x.shape)}); give one logical name or None per dim"
        )
    if not isinstance(x, DTensor):
        return x
    state = active_state()
    if state is None:
        return x

    def decide():
        where = f"constrain{axes}"
        dims = state.rules.mesh_axes(axes, "compute", where, strict=False)
        return placements_for(x.device_mesh, dims, x.shape, f"activation {where} in {tags.current_module()!r}")

    target = state.target(("constrain", axes, tuple(x.shape), id(x.device_mesh)), decide)
    return move(x, target, tags.current_module(), f"constrain{tuple(axes)}")


def finish_output(output, name):
    """A scalar (the loss), alone or in a ModelOutput, dict or tuple, made whole on every rank and plain."""

    def whole(t):
        if isinstance(t, DTensor) and t.ndim == 0:
            # (spmd's to_local: DTensor's builds a spec for the gradient on every backward)
            return to_local(move(t, grad_layout(t.placements), name, "make the loss whole on every rank"))
        return t

    return map_tensors(output, whole)
