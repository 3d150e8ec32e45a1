"""Naming tensor axes: `annotate` for parameters and buffers, `P` to pin mesh axes directly.

Annotations are plain attributes on the tensor; nothing happens until `spmd.parallelize` reads them.
`fake_copy` copies a model without its data and keeps the annotations (for shapes, FLOPs and plans).
"""

import copy
import fnmatch

import torch
import torch.nn as nn
from torch.distributed.tensor import Placement

__all__ = [
    "P",
    "annotate",
    "annotate_by_name",
    "get_axes",
    "get_pin",
    "copy_annotations",
    "infer_axes",
    "fake_copy",
    "out_dim",
    "computes_in_float8",
]

AXES_ATTR = "_spmd_axes"  # tuple of logical names / None, one per dim
PIN_ATTR = "_spmd_pin"  # P(...) over mesh axes, or a list of DTensor placements


class P(tuple):
    """A PartitionSpec over mesh axes, one entry per tensor dim: a mesh axis, a tuple of them, or None."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __repr__(self):
        return f"P{tuple.__repr__(self)}"


def annotate(tensor: torch.Tensor, *axes):
    """Records the logical axes of `tensor` (one name or None per dim), or pins its layout with
    `P(...)` / a list of DTensor placements. Returns the tensor."""
    if len(axes) == 1 and isinstance(axes[0], P):
        pin = axes[0]
        if len(pin) != tensor.dim():
            raise ValueError(
                f"{pin} has {len(pin)} entries but the tensor has {tensor.dim()} dims "
                f"(shape {tuple(tensor.shape)}); give one entry per dim"
            )
        setattr(tensor, PIN_ATTR, pin)
        return tensor
    if (
        len(axes) == 1
        and isinstance(axes[0], (list, tuple))
        and axes[0]
        and all(isinstance(p, Placement) for p in axes[0])
    ):
        setattr(tensor, PIN_ATTR, list(axes[0]))
        return tensor
    if len(axes) != tensor.dim():
        raise ValueError(
            f"annotate got {len(axes)} axes {axes} for a tensor with {tensor.dim()} dims "
            f"(shape {tuple(tensor.shape)}); give one logical name or None per dim"
        )
    for a in axes:
        if a is not None and not isinstance(a, str):
            raise TypeError(f"logical axis names are strings or None, got {a!r}; use spmd.P(...) for mesh axes")
    setattr(tensor, AXES_ATTR, tuple(axes))
    return tensor


def annotate_by_name(model: nn.Module, table: dict) -> int:
    """Annotates parameters and buffers whose qualified names match glob patterns, e.g.
    `{"*.q_proj.weight": ("heads", "embed")}`. Every pattern must match something. Returns the count."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    total = 0
    for pattern, axes in table.items():
        hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"annotate_by_name: pattern {pattern!r} matches no parameter or buffer; "
                f"names look like {list(named)[:3]}"
            )
        for n in hits:
            annotate(named[n], *(axes if isinstance(axes, tuple) and not isinstance(axes, P) else (axes,)))
        total += len(hits)
    return total


def get_axes(t: torch.Tensor):
    return getattr(t, AXES_ATTR, None)


def get_pin(t: torch.Tensor):
    return getattr(t, PIN_ATTR, None)


def copy_annotations(src: torch.Tensor, dst: torch.Tensor) -> None:
    for attr in (AXES_ATTR, PIN_ATTR):
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))


def infer_axes(model: nn.Module, failed: list | None = None) -> dict[str, tuple]:
    """Logical axes of every parameter: its annotation, or inferred where unambiguous.

    A bias follows its weight's output axis; a 1-d weight of a norm layer follows `embed`.
    Anything else unannotated is an error that names the parameter and how to annotate it, or, given a
    list `failed`, is appended to it.
    """
    result: dict[str, tuple] = {}
    embed_sizes = set()
    for _, p in model.named_parameters():
        axes = get_axes(p)
        if axes:
            embed_sizes.update(s for s, a in zip(p.shape, axes) if a == "embed")
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if get_pin(p) is not None:
                continue
            axes = get_axes(p)
            if axes is None:
                try:
                    axes = _infer_one(module, p_name, p, embed_sizes, full)
                except ValueError:
                    if failed is None:
                        raise
                    failed.append(f"{full} {tuple(p.shape)}")
                    continue
            result[full] = axes
    return result


def out_dim(module: nn.Module) -> int | None:
    """The weight dim that holds a layer's output features: 0 for nn.Linear, 1 for nn.Embedding and for
    transformers' Conv1D (stored [in, out]); None for other modules."""
    if isinstance(module, nn.Linear):
        return 0
    if isinstance(module, nn.Embedding) or type(module).__name__ == "Conv1D":
        return 1
    return None


def computes_in_float8(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear: its matmuls scale each operand by max|x| over the whole
    tensor, a statistic of the whole batch, not of one row."""
    return isinstance(module, nn.Linear) and type(module).__name__ == "Float8Linear"


def _infer_one(module, p_name, p, embed_sizes, full):
    if p.dim() == 0:
        return ()
    weight = getattr(module, "weight", None)
    if p_name == "bias" and isinstance(weight, torch.Tensor) and get_axes(weight):
        return (get_axes(weight)[out_dim(module) or 0],)
    if p.dim() == 1 and "norm" in type(module).__name__.lower() and p.shape[0] in embed_sizes:
        return ("embed",)
    raise ValueError(
        f"cannot infer the logical axes of parameter {full!r} with shape {tuple(p.shape)}; annotate it, "
        f"e.g. spmd.annotate(model.{full}, {', '.join(repr('axis') for _ in p.shape)}) or "
        f"spmd.annotate_by_name(model, {{{full!r}: (...)}}), using None for dims that stay whole"
    )


def fake_copy(model: nn.Module, mode=None) -> nn.Module:
    """A copy of `model` whose tensors hold no data (fake CPU tensors under the FakeTensorMode `mode`, else
    meta tensors), annotations kept, without copying any weights."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if mode is None:
            clone = torch.empty_like(t, device="meta")
        else:
            with mode:
                clone = torch.empty_like(t, device="cpu")
        if isinstance(t, nn.Parameter):
            clone = nn.Parameter(clone, requires_grad=t.requires_grad)
        clone.__dict__.update({k: v for k, v in t.__dict__.items() if k.startswith("_spmd")})
        memo[id(t)] = clone
    return copy.deepcopy(model, memo)
