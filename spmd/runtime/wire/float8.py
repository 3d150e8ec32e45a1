"""A flat parameter all-gather with float8 layers' weights in float8 (torchao's float8 all-gather for FSDP2).

`comm={"params": "float8"}`: each weight of a Float8Linear (spmd.float8_training) travels as e4m3 codes cast
with its tensorwise scale, 448 / max|w| over the whole weight, as the layer casts it: one max all-reduce over
the mesh gives every rank the maxima of the group's float8 weights, so every rank casts its shard with the
scale one device would use, and no scale needs to travel. The other members (norms, biases, the output head)
travel in their compute dtype, bit for bit. Each rank's row is its members' bytes back to back; after the
gather the codes are unscaled to the compute dtype, and the layer's own cast of that weight finds the same
maximum (to fp32 rounding) and so the same codes: the matmul sees what it would see on one device, for one
byte per weight value on the wire instead of two (bf16) or four.
"""

import weakref

import torch
import torch.distributed._functional_collectives as funcol

from ...layout.annotate import computes_in_float8
from .. import tags
from .flat import Pending, all_gather_single, tagged, waited

__all__ = ["FLOAT8_MAX", "float8_weights", "gather_members", "scales_for"]

FLOAT8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_EPS = 1e-12  # torchao's floor under an all-zero weight's max
_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def float8_weights(module) -> set:
    """ids of the weights of the Float8Linear layers in `module` (None: no module, no float8 weight)."""
    if module is None:
        return set()
    if module not in _WEIGHTS:
        _WEIGHTS[module] = {id(m.weight) for m in module.modules() if computes_in_float8(m)}
    return _WEIGHTS[module]


def scales_for(tensors: list, mesh) -> torch.Tensor:
    """448 / max|w| of each whole weight, whose shards (`tensors`, this rank's) lie over `mesh`: one max
    all-reduce per mesh dimension, the ranks that hold a replica adding nothing to the max."""
    amax = torch.stack([t.detach().abs().amax().float() for t in tensors])
    now = tags.current_reason()
    module = now[0] if now else ""
    with tags.reason(module, f"max|w| of {len(tensors)} float8 weights for their scales (torchao's tensorwise)"):
        for m in range(mesh.ndim):
            if mesh.size(m) > 1:
                amax = funcol.all_reduce(amax, "max", (mesh, m))
    # torchao's amax_to_scale: the quotient in float64, then float32
    return (FLOAT8_MAX / torch.clamp(waited(amax).double(), min=_EPS)).float()


def gather_members(tensors: list, is_float8: list, mesh, m: int) -> Pending:
    """Every rank's members (`tensors`, one dtype), gathered over mesh dim `m`: `wait()` gives an (n, total)
    tensor in that dtype, row r being rank r's members back to back (as the plain flat gather gives)."""
    dtype, n = tensors[0].dtype, mesh.size(m)
    with torch.no_grad():
        scales = scales_for([t for t, f in zip(tensors, is_float8) if f], mesh) if any(is_float8) else torch.empty(0)
        parts, scale = [], iter(scales)
        for t, f in zip(tensors, is_float8):
            if f:  # its e4m3 codes
                t = (t.float() * next(scale)).clamp_(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
            parts.append(t.reshape(-1).view(torch.uint8))
        row = torch.cat(parts)
        with tagged("float8"):
            out = all_gather_single(row, 0, (mesh, m))
    shapes = [(t.numel(), f) for t, f in zip(tensors, is_float8)]
    return Pending(out, lambda got: _decode(got.view(n, -1), shapes, scales, dtype))


def _decode(rows: torch.Tensor, shapes: list, scales: torch.Tensor, dtype) -> torch.Tensor:
    """(n, bytes) gathered rows -> (n, values) in `dtype`: codes unscaled, the rest reinterpreted."""
    out, at, scale = [], 0, iter(scales)
    for numel, f in shapes:
        width = numel if f else numel * dtype.itemsize
        part = rows[:, at : at + width].contiguous()
        out.append((part.view(torch.float8_e4m3fn).float() / next(scale)).to(dtype) if f else part.view(dtype))
        at += width
    return torch.cat(out, dim=1)
