"""Run a single-device kernel on the local shards of DTensor inputs, where the layout makes that exact.

Each wrapper checks the placements, calls the kernel on `to_local()` tensors and wraps the result back with
the input's placements. A replicated weight used by token-sharded activations gets a Partial gradient
(each rank holds the sum over its own tokens), which is what autograd through DTensor ops gives too.
"""

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def _shard_dims(t: DTensor, name: str) -> set[int]:
    dims = set()
    for p in t.placements:
        if isinstance(p, Shard):
            dims.add(p.dim % t.ndim)
        elif not isinstance(p, Replicate):
            raise ValueError(
                f"the triton {name} kernel takes Shard/Replicate DTensors, got {t.placements}; "
                f"use impl='torch' or redistribute"
            )
    return dims


def _replicated(t, like: DTensor, name: str, what: str) -> DTensor:
    if not isinstance(t, DTensor) or t.device_mesh != like.device_mesh:
        raise ValueError(f"the triton {name} kernel on DTensor inputs needs {what} as a DTensor on the same mesh")
    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"the triton {name} kernel needs {what} replicated, got {t.placements}")
    return t


def _wrap(local, like: DTensor) -> DTensor:
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def rms_norm(fn, x: DTensor, weight, eps: float) -> DTensor:
    if x.ndim - 1 in _shard_dims(x, "rms_norm"):
        raise ValueError(f"the triton rms_norm kernel needs the normalized (last) dim unsharded, got {x.placements}")
    weight = _replicated(weight, x, "rms_norm", "weight")
    w_grad = [Partial() if isinstance(p, Shard) else Replicate() for p in x.placements]
    y = fn(x.to_local(), weight.to_local(grad_placements=w_grad), eps)
    return _wrap(y, x)


def swiglu(fn, gate: DTensor, up) -> DTensor:
    _shard_dims(gate, "swiglu")
    if not isinstance(up, DTensor) or up.device_mesh != gate.device_mesh or up.placements != gate.placements:
        raise ValueError("the triton swiglu kernel on DTensor inputs needs gate and up with the same placements")
    return _wrap(fn(gate.to_local(), up.to_local()), gate)


def apply_rope(fn, q: DTensor, k, cos, sin):
    if not isinstance(k, DTensor) or k.device_mesh != q.device_mesh:
        raise ValueError("the triton rope kernel on DTensor inputs needs q and k as DTensors on one mesh")
    for t, name in ((q, "q"), (k, "k")):
        bad = _shard_dims(t, "rope") & {1, 3}
        if bad:
            raise ValueError(
                f"the triton rope kernel cannot take {name} sharded on the sequence or head_dim "
                f"dim (placements {t.placements}); only batch and heads may be sharded"
            )
    cos = _replicated(cos, q, "rope", "cos").to_local() if isinstance(cos, DTensor) else cos
    sin = _replicated(sin, q, "rope", "sin").to_local() if isinstance(sin, DTensor) else sin
    q_out, k_out = fn(q.to_local(), k.to_local(), cos, sin)
    return _wrap(q_out, q), _wrap(k_out, k)
