"""`parallelize(model, mesh, rules)`: lays a global-view model out on a mesh, in place.

Parameters become DTensors in their storage layout (the params map). Hooks on every module then run the
propagation pass as the model runs: before a module computes, its parameters are gathered to their
compute layout (and cast to the compute dtype); a linear layer's input is moved to the layout its weight
needs (`propagate.plan_linear`); `constrain` points move activations to the rules' layout. After the
forward of a module, gathered parameters are dropped and regathered for backward (ZeRO-3), unless the
module sits under activation checkpointing, which regathers by recomputing.
"""
import contextlib
from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from . import ops  # noqa: F401  (registers sharding strategies)
from . import record
from .annotate import copy_annotations, get_pin, infer_axes
from .buckets import Bucket, gather_bucket, make_buckets
from .moves import _grad_layout, gather_param, move
from .propagate import plan_linear
from .reshard import CHECKPOINTED_ATTR, reshard_after_forward, storage_key
from .rules import Rules, _as_axes, placements_for

STATE_ATTR = "_spmd_state"


class SPMDState:
    def __init__(self, mesh, rules, param_dtype, reduce_dtype, input_axes):
        self.mesh, self.rules = mesh, rules
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.input_axes = input_axes
        self.sync = True
        self.decisions: dict[tuple, object] = {}
        self.move_cache: dict = {}
        self.names: dict[int, str] = {}
        self.saved_hooks: list = []
        self.shared_gathers: dict = {}         # gathered copies of parameters several modules hold
        self.buckets: dict[int, Bucket] = {}   # id(block) -> the bucket its parameters gather and reduce in
        self.bucket_of: dict[int, Bucket] = {}  # id(param) -> its bucket
        self.bucket_values: dict = {}          # id(param) -> gathered value, while its block runs forward
        self.prefetched: dict = {}             # id(bucket) -> its gather, issued while the block before ran


_active: list[SPMDState] = []


def active_state() -> SPMDState | None:
    return _active[-1] if _active else None


@contextlib.contextmanager
def activated(state: SPMDState | None):
    """Makes `state` the one `constrain` sees (recomputation under checkpointing runs outside the hooks)."""
    if state is None:
        yield
        return
    _active.append(state)
    try:
        yield
    finally:
        _active.pop()


def param_layouts(model: nn.Module, mesh: DeviceMesh, rules: Rules):
    """(storage, compute) placements of every parameter, by qualified name."""
    axes = infer_axes(model)
    layouts = {}
    for name, p in model.named_parameters():
        pin = get_pin(p)
        if pin is not None:
            if all(hasattr(x, "is_shard") for x in pin):
                storage = tuple(pin)
            else:
                dims = [_as_axes(e, f"P spec of {name}") for e in pin]
                storage = tuple(placements_for(mesh, dims, p.shape, f"parameter {name!r}"))
            layouts[name] = (storage, storage)
            continue
        where = f"parameter {name!r} with axes {axes[name]}"
        storage = placements_for(mesh, rules.mesh_axes(axes[name], "params", where), p.shape, f"parameter {name!r}")
        compute = placements_for(mesh, rules.mesh_axes(axes[name], "compute", where), p.shape, f"parameter {name!r}")
        for s, c in zip(storage, compute):
            if c.is_shard() and s != c:
                raise ValueError(f"parameter {name!r}: the params map must keep the compute sharding "
                                 f"({compute}) and only add to it, got storage {storage}")
        layouts[name] = (tuple(storage), tuple(compute))
    return layouts


def parallelize(model: nn.Module, mesh: DeviceMesh, rules: Rules, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, input_axes=None, param_init=None,
                bucket: bool = True) -> nn.Module:
    """Lays `model` out on `mesh` following `rules`, in place, and returns it.

    Plain-tensor inputs (positional or keyword) are this rank's slice of the batch (as with DDP);
    `input_axes` names their logical axes: one tuple for every input, or a dict from argument position
    or keyword to a tuple (default: `batch` first, the rest whole). A scalar output (the loss) comes back
    as a plain tensor, the same on every rank.

    `bucket`: the parameters of each repeated block (spmd.find_blocks) gather in one collective per mesh
    axis and their gradients reduce in one (spmd.buckets); False moves every parameter on its own.

    A model built on the meta device (too large for one device) needs `param_init(name, meta_tensor)`:
    it returns the full initial value of each meta parameter and buffer (called once each, in
    `named_parameters` order), and this rank keeps its slice, so one full tensor exists at a time. Given
    the values a one-device build has (e.g. `Llama.initializer(seed)`), every layout holds the same model.
    """
    if hasattr(model, STATE_ATTR):
        raise ValueError("this model is already parallelized; build a fresh model to lay it out again")
    state = SPMDState(mesh, rules, param_dtype, reduce_dtype, input_axes)
    layouts = param_layouts(model, mesh, rules)  # every check runs before anything changes
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None and param_init is None:
        raise _needs_param_init(meta)
    converted: dict[int, nn.Parameter] = {}
    uses = Counter()
    for mod_name, module in model.named_modules():
        for p_name, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(p) not in converted:
                storage, compute = layouts[full]
                dt = distribute_tensor(_initial(p, full, param_init), mesh, storage, src_data_rank=None)
                new = nn.Parameter(dt, requires_grad=p.requires_grad)
                copy_annotations(p, new)
                new._spmd_compute = compute
                new._spmd_name = full
                converted[id(p)] = new
            module._parameters[p_name] = converted[id(p)]
        for b_name, b in list(module._buffers.items()):
            if b is not None and not isinstance(b, DTensor):
                full = f"{mod_name}.{b_name}" if mod_name else b_name
                placements = get_pin(b) or placements_for(
                    mesh, rules.mesh_axes(getattr(b, "_spmd_axes", None) or (None,) * b.dim(), "compute",
                                          f"buffer {full!r}"), b.shape, f"buffer {full!r}")
                module._buffers[b_name] = distribute_tensor(_initial(b, full, param_init), mesh, placements,
                                                            src_data_rank=None)
        state.names[id(module)] = mod_name
        uses.update(id(p) for p in module._parameters.values() if p is not None)
        module.register_forward_pre_hook(_pre_hook(state, mod_name, module, module is model), with_kwargs=True)
        module.register_forward_hook(_post_hook(state, module, module is model), always_call=True)
    for p in converted.values():
        if uses[id(p)] > 1:
            p._spmd_shared = True
    if bucket:
        state.buckets, state.bucket_of = make_buckets(model, mesh)
    setattr(model, STATE_ATTR, state)
    return model


def _needs_param_init(name: str) -> ValueError:
    return ValueError(f"{name!r} is on the meta device; pass parallelize(..., param_init=fn) with fn(name, tensor) "
                      f"returning its initial value (e.g. the model's initializer()), or build the model on a device")


def _initial(t: torch.Tensor, name: str, param_init) -> torch.Tensor:
    if not t.is_meta:
        return t.data
    if param_init is None:
        raise _needs_param_init(name)
    with torch.no_grad():
        value = param_init(name, t)
    if tuple(value.shape) != tuple(t.shape) or value.is_meta:
        raise ValueError(f"param_init({name!r}) returned {'a meta tensor' if value.is_meta else tuple(value.shape)}; "
                         f"expected a real tensor of shape {tuple(t.shape)}")
    return value.to(t.dtype)


def _to_dtensor(state: SPMDState, t, key):
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        return t
    axes = state.input_axes.get(key) if isinstance(state.input_axes, dict) else state.input_axes
    axes = axes or ("batch",) + (None,) * (t.dim() - 1)
    dims = state.rules.mesh_axes(axes, "compute", "model input", strict=False)
    placements = placements_for(state.mesh, dims, None, "model input")
    return DTensor.from_local(t, state.mesh, placements, run_check=False)


def _pre_hook(state: SPMDState, name: str, module: nn.Module, is_root: bool):
    # parameters are read from the module at call time, not captured here, so that a compiled block's
    # graph takes them as inputs and serves every block of the same type
    param_names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
    is_linear = isinstance(module, nn.Linear)

    def hook(mod, args, kwargs):
        checkpointed = getattr(mod, CHECKPOINTED_ATTR, False)
        _active.append(state)
        record.push_module(name)
        if is_root:
            state.move_cache.clear()
            state.shared_gathers.clear()
            state.prefetched.clear()  # left over only if a forward stopped early
            args = tuple(_to_dtensor(state, a, i) for i, a in enumerate(args))
            kwargs = {k: _to_dtensor(state, v, k) for k, v in kwargs.items()}
        bucket = None if torch.compiler.is_compiling() else state.buckets.get(id(mod))
        if bucket is not None:
            state.bucket_values.update(gather_bucket(bucket, state))
        w_override = None
        if is_linear and isinstance(args[0], DTensor):
            args, w_override = _plan_linear_input(state, name, mod, args)
        regather = {}
        for p_name in param_names:
            p = mod._parameters[p_name]
            compute = w_override if (w_override is not None and p_name == "weight") else p._spmd_compute
            if getattr(p, "_spmd_shared", False):
                # a weight several modules use (tied embeddings) is gathered once per forward, so its
                # gradient contributions sum before one reduction
                key = (id(p), tuple(compute))
                g = state.shared_gathers.get(key)
                if g is None:
                    g = state.shared_gathers[key] = gather_param(p, compute, state.param_dtype,
                                                                 state.reduce_dtype, state, name, p._spmd_name)
            else:
                g = None
                if state.bucket_values and not torch.compiler.is_compiling() and compute is p._spmd_compute:
                    g = state.bucket_values.get(id(p))  # gathered with its block
                if g is None:
                    g = gather_param(p, compute, state.param_dtype, state.reduce_dtype, state, name, p._spmd_name)
            mod.__dict__[p_name] = g
            if _moves_data(p.placements, compute, state.mesh) and not torch.compiler.is_compiling():
                regather[storage_key(g)] = (p, compute)
        hooks = None
        if regather and not checkpointed and not torch.compiler.is_compiling():
            hooks = reshard_after_forward(regather, state, name)
            hooks.__enter__()
        state.saved_hooks.append(hooks)
        return args, kwargs

    return hook


def _moves_data(storage, compute, mesh) -> bool:
    return any(s != c and mesh.size(i) > 1 for i, (s, c) in enumerate(zip(storage, compute)))


def _plan_linear_input(state, name, mod, args):
    x = args[0]
    w = mod._parameters["weight"]
    el = torch.finfo(state.param_dtype).bits // 8 if state.param_dtype else w.element_size()
    if torch.compiler.is_compiling():
        # the same decision without its bookkeeping: a graph that names its module serves only that module
        x_target, w_target, _ = plan_linear(x, w.shape, w._spmd_compute, el, "")
    else:
        x_target, w_target, decisions = plan_linear(x, w.shape, w._spmd_compute, el, name)
        for d in decisions:
            state.decisions[(name, d.mesh_axis)] = d
    key = (id(x), x_target)
    if key not in state.move_cache:
        why = "move input to the layout its weight needs"
        moved = move(x, x_target, name, why, grad_placements=_grad_layout(x.placements)) if x.requires_grad \
            else move(x, x_target, name, why)
        state.move_cache[key] = (x, moved)
    return (state.move_cache[key][1],) + tuple(args[1:]), (w_target if w_target != tuple(w._spmd_compute) else None)


def _post_hook(state: SPMDState, module: nn.Module, is_root: bool):
    names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
    has_children = next(module.children(), None) is not None

    def hook(mod, args, output):
        bucket = None if torch.compiler.is_compiling() else state.buckets.get(id(mod))
        if bucket is not None:
            for p in bucket.params:
                state.bucket_values.pop(id(p), None)
        hooks = state.saved_hooks.pop() if state.saved_hooks else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for n in names:
            mod.__dict__.pop(n, None)
        if has_children:
            state.move_cache.clear()
        if is_root:
            state.shared_gathers.clear()
            output = _finish_output(output, record.current_module())
        record.pop_module()
        if _active:
            _active.pop()
        return output

    return hook


def _finish_output(output, name):
    if isinstance(output, DTensor) and output.ndim == 0:
        replicated = move(output, _grad_layout(output.placements), name, "make the loss whole on every rank")
        return replicated.to_local()
    return output


class no_sync:
    """Context manager: backward passes inside leave gradients unreduced (gradient accumulation);
    the first backward outside reduces everything accumulated, once."""

    def __init__(self, model: nn.Module):
        if not hasattr(model, STATE_ATTR):
            raise ValueError("no_sync needs a model laid out by spmd.parallelize")
        self.state = getattr(model, STATE_ATTR)

    def __enter__(self):
        self.state.sync = False
        return self

    def __exit__(self, *exc):
        self.state.sync = True
