"""Fused kernels with one switch: `impl="torch"` runs the plain-torch reference, `impl="triton"` the Triton
kernel, `impl="auto"` picks Triton for CUDA tensors and the reference otherwise.

DTensor inputs: cross_entropy always runs vocab-parallel (the logits are never gathered); the other
kernels run the reference on the DTensor under "auto"/"torch", and the Triton kernel on the local shards
under "triton" where the layout allows it (see local_shards.py).

The Triton modules (kernels/rms_norm.py, ...) are imported on first use, so `import kernels` needs no
triton and TRITON_INTERPRET may be set any time before the first Triton call. They share their names with
the functions below; the package keeps the functions (see _Package).
"""

import importlib
import sys
import types

from torch.distributed.tensor import DTensor

from . import local_shards, reference
from .vocab_parallel import vocab_parallel_cross_entropy

IMPLS = ("auto", "torch", "triton")
_TRITON_MODULES = ("rms_norm", "swiglu", "rope", "cross_entropy", "linear_cross_entropy")


def _use_triton(impl: str, x) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"kernels impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    return x.is_cuda and not isinstance(x, DTensor)


def _triton(module: str):
    return importlib.import_module(f"{__name__}.{module}")


def rms_norm(x, weight, eps: float = 1e-6, impl: str = "auto"):
    if not _use_triton(impl, x):
        return reference.rms_norm(x, weight, eps)
    fn = _triton("rms_norm").rms_norm
    return local_shards.rms_norm(fn, x, weight, eps) if isinstance(x, DTensor) else fn(x, weight, eps)


def swiglu(gate, up, impl: str = "auto"):
    if not _use_triton(impl, gate):
        return reference.swiglu(gate, up)
    fn = _triton("swiglu").swiglu
    return local_shards.swiglu(fn, gate, up) if isinstance(gate, DTensor) else fn(gate, up)


def apply_rope(q, k, cos, sin, impl: str = "auto"):
    """cos/sin: [T, D] tables, or [B, T, D] ones gathered at each token's position (positions given)."""
    if not _use_triton(impl, q) or cos.ndim == 3:
        return reference.apply_rope(q, k, cos, sin)
    fn = _triton("rope").apply_rope
    return local_shards.apply_rope(fn, q, k, cos, sin) if isinstance(q, DTensor) else fn(q, k, cos, sin)


def cross_entropy(logits, targets, ignore_index: int = -100, impl: str = "auto"):
    """Mean cross-entropy of [..., V] logits against [...] targets."""
    use_triton = _use_triton(impl, logits)
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets, ignore_index)
    logits, targets = logits.flatten(0, -2), targets.flatten()
    if not use_triton:
        return reference.cross_entropy(logits, targets, ignore_index)
    return _triton("cross_entropy").cross_entropy(logits, targets, ignore_index)


def linear_cross_entropy(hidden, weight, targets, ignore_index: int = -100, impl: str = "auto"):
    use_triton = _use_triton(impl, hidden)
    if not use_triton and isinstance(hidden, DTensor):
        return cross_entropy(hidden @ weight.t(), targets, ignore_index)  # vocab-parallel on DTensor logits
    if not use_triton:
        return reference.linear_cross_entropy(hidden, weight, targets, ignore_index)
    if isinstance(hidden, DTensor) or isinstance(weight, DTensor):
        raise ValueError(
            "the chunked linear_cross_entropy runs on plain tensors only; with DTensors use "
            "impl='torch' (a DTensor matmul, then vocab-parallel cross-entropy)"
        )
    return _triton("linear_cross_entropy").linear_cross_entropy(hidden, weight, targets, ignore_index)


class _Package(types.ModuleType):
    """Importing kernels.rms_norm (the module) would rebind the package attribute `rms_norm` to it and
    shadow the function; this keeps the functions."""

    def __setattr__(self, name, value):
        if name in _TRITON_MODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
