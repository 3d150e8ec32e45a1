"""The `comm` setting of spmd.parallelize: in what precision parameters and gradients travel.

`comm={"params": "int8" | "fp8" | "float8" | None, "grads": "int8" | "int4" | None, "block": N, "hpz": axis | None}`
is checked here, whole, before anything moves; a bad key or value names the fix. `hpz` names the mesh
axis that keeps a secondary copy of the parameter shards for backward's regather (ZeRO++'s hpZ).
"""

from dataclasses import dataclass

from .quantize import DEFAULT_BLOCK, INT4_BLOCK

__all__ = ["Wire", "wire_setting", "PARAM_FORMATS", "GRAD_FORMATS"]

PARAM_FORMATS = (None, "int8", "fp8", "float8")
GRAD_FORMATS = (None, "int8", "int4")
_KEYS = ("params", "grads", "block", "hpz")


@dataclass(frozen=True)
class Wire:
    params: str | None = None  # parameter all-gathers: quantized payload + scales
    grads: str | None = None  # gradient reductions: qgZ's quantized all-to-all, summed in fp32
    block: int | None = None  # values per fp32 scale; None: each format's default (`block_for`)
    hpz: str | None = None

    def block_for(self, fmt: str) -> int:
        """Values per scale in format `fmt`: the `block` given, else INT4_BLOCK for int4, DEFAULT_BLOCK else."""
        return self.block or (INT4_BLOCK if fmt == "int4" else DEFAULT_BLOCK)

    @property
    def compressed(self) -> bool:
        return self.params is not None or self.grads is not None


def wire_setting(comm, mesh_axes: tuple, compiled: bool = False, float8: bool = False) -> Wire | None:
    """The validated `Wire` for `comm` on a mesh with axes `mesh_axes`; None when nothing is set. `compiled`:
    whether the model holds blocks compiled before it was laid out, which gather inside their graphs. `float8`:
    whether it holds float8 layers (spmd.float8_training), whose weights `params="float8"` gathers."""
    if comm is None:
        return None
    if compiled:
        raise ValueError(
            "comm= does not apply to blocks compiled before parallelize (spmd.compile_blocks): they gather "
            "and reduce inside their graphs, through DTensor's redistribute, which has no quantized wire; "
            "call compile_blocks after parallelize(comm=...), or pass comm=None"
        )
    if not isinstance(comm, dict):
        raise ValueError(f"comm={comm!r} must be a dict such as {{'params': 'int8', 'grads': 'int4'}} (or None)")
    unknown = sorted(set(comm) - set(_KEYS))
    if unknown:
        raise ValueError(f"comm has unknown keys {unknown}; use {list(_KEYS)}")
    wire = Wire(**comm)
    _check(wire.params, PARAM_FORMATS, "params", "the parameter all-gathers")
    _check(wire.grads, GRAD_FORMATS, "grads", "the gradient reductions")
    if wire.params == "float8" and not float8:
        raise ValueError(
            "comm['params']='float8' gathers the weights of float8 layers in float8, and this model has none; "
            "call spmd.float8_training(model) before parallelize, or use 'fp8' (block-wise scales, any parameter)"
        )
    if wire.block is not None and (type(wire.block) is not int or wire.block < 2 or wire.block % 2):
        raise ValueError(
            f"comm['block']={wire.block!r} must be an even int >= 2 (values per fp32 scale); the default "
            f"is {DEFAULT_BLOCK} ({INT4_BLOCK} for int4 gradients)"
        )
    if wire.hpz is not None and wire.hpz not in mesh_axes:
        raise ValueError(
            f"comm['hpz']={wire.hpz!r} is not an axis of the mesh {tuple(mesh_axes)}; name the axis inside "
            f"a node that keeps backward's secondary parameter shards (e.g. 'fsdp'), or None"
        )
    return wire if (wire.compressed or wire.hpz is not None) else None


def _check(value, allowed: tuple, key: str, what: str):
    if value not in allowed:
        raise ValueError(f"comm[{key!r}]={value!r} is not supported; {what} travel in one of {list(allowed)}")
