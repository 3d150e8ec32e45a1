"""Local tensors into and out of DTensors without from_local's per-call work: a layout's spec is built once and
shared, and the local tensor stays where it lives.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info

__all__ = [
    "local_of",
    "wrap_local",
    "as_dtensor",
    "cast",
    "cast_all",
    "cast_locals",
    "layout_spec",
    "contiguous_stride",
]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no autograd node, unlike `to_local`), or `t` itself when it is plain."""
    return t._local_tensor if isinstance(t, DTensor) else t


def wrap_local(local: torch.Tensor, mesh, placements, shape, stride, requires_grad: bool = False) -> DTensor:
    """A DTensor of global `shape` and `stride` whose local tensor is `local` itself, wherever it lives
    (`DTensor.from_local` moves a host tensor to the mesh's device: offloaded state would return to the GPU)."""
    # the constructor alone: DTensor.__init__'s dynamo and export wrappers cost a third of a wrap
    return DTensor.__new__(
        DTensor, local, layout_spec(mesh, placements, shape, stride, local.dtype), requires_grad=requires_grad
    )


def as_dtensor(t: torch.Tensor, mesh, placements) -> DTensor:
    """`DTensor.from_local(t, mesh, placements, run_check=False)`: a tensor outside autograd (token ids, a
    mask made in forward) wrapped with a layout's cached spec, one that requires grad through from_local."""
    if t.requires_grad:
        return DTensor.from_local(t, mesh, placements, run_check=False)
    shape, stride = compute_global_tensor_info(t, mesh, placements)
    return wrap_local(t.view_as(t), mesh, placements, shape, stride)


def cast(t: DTensor, dtype) -> DTensor:
    """`t.to(dtype)` for a gradient: the cast of its local tensor in the same layout (elementwise, so partial
    sums stay partial sums), without DTensor's dispatch, one per parameter per step in mixed precision."""
    return cast_all([t], dtype)[0]


def cast_all(ts: list, dtypes) -> list:
    """`cast(t, dtype)` for each DTensor of `ts` (None stays None), `dtypes` one or one per tensor."""
    dtypes = dtypes if isinstance(dtypes, (list, tuple)) else [dtypes] * len(ts)
    out = list(ts)
    groups: dict = {}  # dtype -> indices whose local tensors cast together (a tensor in autograd casts alone)
    for i, (t, dtype) in enumerate(zip(ts, dtypes)):
        if t is not None and t.dtype != dtype:
            if t.requires_grad:
                out[i] = t.to(dtype)
            else:
                groups.setdefault(dtype, []).append(i)
    for dtype, group in groups.items():
        for i, local in zip(group, cast_locals([ts[i]._local_tensor for i in group], dtype)):
            t = ts[i]
            out[i] = wrap_local(local, t.device_mesh, t.placements, t.shape, t.stride())
    return out


def cast_locals(tensors: list, dtype) -> list:
    """Each tensor in `dtype`; contiguous ones of one device by one foreach copy into one buffer."""
    out = [t if t.dtype == dtype else None for t in tensors]
    batched = [
        i for i, t in enumerate(tensors) if out[i] is None and t.is_contiguous() and t.device == tensors[0].device
    ]
    if len(batched) > 1:
        sources = [tensors[i] for i in batched]
        flat = torch.empty(sum(t.numel() for t in sources), dtype=dtype, device=sources[0].device)
        views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in sources]), sources)]
        torch._foreach_copy_(views, sources)
        for i, v in zip(batched, views):
            out[i] = v
    return [t.to(dtype) if o is None else o for t, o in zip(tensors, out)]


_SPECS: dict = {}  # (id(mesh), placements, shape, stride, dtype) -> its spec (holding the mesh: its id stays its own)


def layout_spec(mesh, placements, shape, stride, dtype) -> DTensorSpec:
    """The DTensorSpec of a layout, built once: the same few layouts recur every step, and building a spec
    costs several times wrapping a tensor in one (23 us against 6 us on one CPU thread)."""
    key = (id(mesh), tuple(placements), tuple(shape), tuple(stride), dtype)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= 4096:  # shapes that vary (sequence lengths) would otherwise grow it without end
            _SPECS.clear()
        spec = _SPECS[key] = DTensorSpec(mesh, key[1], tensor_meta=TensorMeta(torch.Size(shape), key[3], dtype))
    return spec


def contiguous_stride(shape) -> tuple:
    """A shape's contiguous strides (torch._prims_common's own checks every dim: 30x slower on this hot path)."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
