"""Plain tensors a model makes while it runs (positions, masks, `arange`, constants) are replicated.

Made from global shapes, they are the same whole tensor on every rank: a replicated DTensor. While the model runs
forward (or recomputes), a torch-function mode wraps every plain tensor meeting a DTensor so, hands parameters used
outside their module their compute layout (parameters.outside_use), and runs cp attention as a ring. A view
merging a sequence-sharded dim into the batch dim (OPT's `x.reshape(-1, hidden)`) gathers it first; the view back
splits it again, keeping its gradient in that layout.
"""

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .. import tags
from ..context_parallel import ring
from ..dtensor import partial_scale
from ..dtensor.wrap import as_dtensor, local_of
from ..parameters import outside_use
from . import attention_memory, loss
from .moves import grad_layout, move

__all__ = ["GlobalView"]


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.numel() != 1


class GlobalView(TorchFunctionMode):
    def __init__(self, state):
        super().__init__()
        self.state = state
        self.merged: dict = {}  # shape before a view merged a sharded dim -> the layout the view gathered

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            return func(*args)  # an attribute read or a unary op: no other tensor to meet, nothing to move
        kwargs = kwargs or {}
        flat = _tensors(args, kwargs)
        mesh = next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
        if mesh is not None and ring.cp_active(mesh):
            ring.check_sequence_order(func, flat)
        if func is torch.cat and mesh is not None and args and isinstance(args[0], (list, tuple)):
            # torch.cat skips a 1-D empty tensor (a cache's start: transformers' DynamicLayer); DTensor does not
            args = ([t for t in args[0] if not (_plain(t) and t.shape == (0,))],) + tuple(args[1:])
            flat = _tensors(args, kwargs)
        if mesh is not None and any(_plain(a) for a in flat):

            def replicate(t):
                return as_dtensor(t, mesh, (Replicate(),) * mesh.ndim) if _plain(t) else t

            args, kwargs = tree_map(replicate, args), tree_map(replicate, kwargs)
            flat = _tensors(args, kwargs)
        if func in partial_scale.MULTIPLIES and len(args) == 2 and not kwargs:
            out = partial_scale.scale_partial(*args)
            if out is not None:
                return out
        if func in loss.FUNCS:
            out = loss.global_mean(func, args, kwargs)
            if out is not None:
                return out
        if func is F.scaled_dot_product_attention:
            attend = ring.ring_attention if ring.applies(args[0]) else _attention
            return attention_memory.attending(attend, *args, **kwargs)
        if func in _VIEWS and isinstance(args[0], DTensor) and tags.current_module():
            x = _gather_merged(args[0], _shape(args[0], args[1:]))
            if x is not args[0]:
                self.merged[tuple(args[0].shape)] = args[0].placements
            try:
                out = func(x, *args[1:], **kwargs)
            except RuntimeError as e:
                if "unevenly sharded" in str(e):
                    raise _uneven_split(x, _shape(x, args[1:])) from e
                raise
            if out.requires_grad and _merged_dims(out.shape, x.shape, inner_only=True):
                return self._view_back(out)
            return out
        if func in outside_use.FUNCS and any(outside_use.stored(a) for a in flat):
            return outside_use.call(self.state, func, args, kwargs)
        return func(*args, **kwargs)

    def _view_back(self, out: DTensor) -> DTensor:
        """The view back to tokens splits again what the merge gathered (a local slice), keeping its gradient in
        that layout so that the backward's reverse view never merges a sharded dim either."""
        before = self.merged.get(tuple(out.shape))
        target = (
            out.placements
            if before is None
            else tuple(b if (p.is_replicate() and b.is_shard()) else p for p, b in zip(out.placements, before))
        )
        why = (
            "keep the gradient of a view back to tokens in its forward layout"
            if target == out.placements
            else "split again the dim the view's merge gathered"
        )
        return move(out, target, tags.current_module(), why, grad_placements=grad_layout(target))


def _uneven_split(x: DTensor, new) -> ValueError:
    """The error of a view splitting a sharded dim into groups (heads) the mesh axis cannot hand out whole."""
    axes = [
        f"{x.device_mesh.mesh_dim_names[i]}={x.device_mesh.size(i)}" for i, p in enumerate(x.placements) if p.is_shard()
    ]
    return ValueError(
        f"{tags.current_module()}: viewing a tensor of shape {tuple(x.shape)}, split over "
        f"{' x '.join(axes)}, as {tuple(new) if new else '?'} splits a sharded dim into groups (heads) "
        f"that do not divide by that mesh size: a rank would hold part of one. Pick a mesh whose size "
        f"there divides the number of groups (heads), and give the rest of the world to dp or fsdp"
    )


_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(q, k, v, *rest, **kwargs):
    """Attention split alike over batch or heads, evenly, runs on the local tensors with this rank's slice of a
    gradient-free mask: DTensor's dispatch would mix in the plain mask and not split it. Else DTensor's."""
    kwargs = {**dict(zip(_SDPA_ARGS, rest)), **kwargs}
    mask = kwargs.pop("attn_mask", None)
    local = (
        not kwargs.get("dropout_p")
        and _split_alike(q, k, v)
        and (mask is None or _replicated_constant(mask, q.device_mesh))
    )
    if not local:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    if mask is not None:
        kwargs["attn_mask"] = _local_slice(mask, q)
    out = F.scaled_dot_product_attention(q.to_local(), k.to_local(), v.to_local(), **kwargs)
    return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)


def _replicated_constant(t, mesh) -> bool:
    """A whole tensor, equal on every rank, with no gradient to carry (a mask)."""
    if not isinstance(t, torch.Tensor) or t.requires_grad:
        return False
    return not isinstance(t, DTensor) or (t.device_mesh == mesh and all(p.is_replicate() for p in t.placements))


def _local_slice(mask: torch.Tensor, q: DTensor) -> torch.Tensor:
    """This rank's part of a whole mask broadcast against scores split as `q` is (batch or heads)."""
    local = local_of(mask)
    offset = local.ndim - 4  # a mask of fewer dims broadcasts from the right
    mesh = q.device_mesh
    for i, p in enumerate(q.placements):  # mesh dims in order: each splits what the ones before left
        d = p.dim + offset if p.is_shard() else -1
        if d >= 0 and local.shape[d] != 1:
            size = local.shape[d] // mesh.size(i)
            local = local.narrow(d, mesh.get_local_rank(i) * size, size)
    return local


def _split_alike(*ts) -> bool:
    if not all(
        isinstance(t, DTensor) and t.device_mesh == ts[0].device_mesh and t.placements == ts[0].placements for t in ts
    ):
        return False
    mesh, split = ts[0].device_mesh, {}  # tensor dim -> ranks it is split over (nested: each axis splits a chunk)
    for i, p in enumerate(ts[0].placements):
        if p.is_partial() or (p.is_shard() and p.dim not in (0, 1)):
            return False
        if p.is_shard():
            split[p.dim] = split.get(p.dim, 1) * mesh.size(i)
    return not any(t.shape[d] % n for t in ts for d, n in split.items())


def _tensors(args, kwargs) -> list:
    """The tensors among an op's arguments, at any depth: walked here, as pytree's flatten costs more than many ops."""
    found = []
    stack = [args, tuple(kwargs.values())]
    while stack:
        for a in stack.pop():
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                stack.append(a)
            elif isinstance(a, dict):
                stack.append(tuple(a.values()))
    return found


_VIEWS = {torch.Tensor.reshape, torch.Tensor.view, torch.reshape}


def _shape(x: torch.Tensor, shape) -> list | None:
    """The target shape of `x.view(*shape)` / `x.reshape(shape)`, -1 resolved; None for a view as a dtype."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    if not shape or not all(isinstance(s, int) for s in shape):
        return None
    known = math.prod(s for s in shape if s != -1)
    return [x.numel() // max(known, 1) if s == -1 else s for s in shape]


def _merged_dims(shape, new, inner_only: bool = False) -> set:
    """Dims of `shape` the view to `new` merges into the dim before them (`inner_only`: not the last dim)."""
    if new is None:
        return set()
    starts = [math.prod(new[:k]) for k in range(len(new) + 1)]
    return {d for d in range(1, len(shape) - inner_only) if math.prod(shape[:d]) not in starts}


def _gather_merged(x: DTensor, new) -> DTensor:
    """`x`, gathered over each mesh axis that shards a dim the view to `new` merges into the dim before it."""
    dims = _merged_dims(x.shape, new)
    merged = [p.is_shard() and p.dim in dims for p in x.placements]
    if not any(merged):
        return x
    target = [Replicate() if m else p for p, m in zip(x.placements, merged)]
    return move(x, target, tags.current_module(), "gather a sharded dim the model's view merges into the dim before it")
