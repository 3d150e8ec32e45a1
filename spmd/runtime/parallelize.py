"""`parallelize(model, mesh, rules)`: lays a global-view model out on a mesh, in place.

Parameters become DTensors in their storage layout (the params map). Hooks on the modules (every module
but the insides of blocks that run on local tensors: spmd.runtime.local.hook_sets) then run the propagation pass as
the model runs: before a module computes, its parameters are gathered to their
compute layout (and cast to the compute dtype); a linear layer's input is moved to the layout its weight
needs (spmd.runtime.activations.moves); `constrain` points move activations to the rules' layout. After the
forward of a module, gathered parameters are dropped and regathered for backward (ZeRO-3), unless the
module sits under activation checkpointing, which regathers by recomputing.
"""
from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..layout.annotate import get_pin, infer_axes, out_dim
from ..layout.heads import check_heads_divide
from ..layout.mesh import flatten_groups, mesh_sizes
from ..layout.rules import Rules, _as_axes, placements_for
from . import dtensor
from .local import hook_sets
from . import tags
from . import state as active
from .gradients.accumulate import reduce_after_backward
from .activations.moves import finish_output, map_tensors, move_linear_input
from .consistency import check_layout_agrees
from .parameters.buckets import make_buckets
from .experts.dispatch import check_expert_layout, install_expert_hooks
from .parameters.host import host_params
from .local.blocks import enter_local, local_blocks
from .local.whole_model import enter_local_model, whole_model_members
from .parameters.gather import gather_block, gather_module_params, release_module_params
from .activations.partials import reduce_partials
from .activations.global_view import GlobalView
from .gradients.reducer import DEFAULT_BUCKET_MB, GradientReducer
from .state import STATE_ATTR, SPMDState
from .parameters.storage import check_param_init, laid_out_buffer, laid_out_param
from .dtensor.wrap import as_dtensor

__all__ = ["parallelize", "no_sync", "param_layouts"]


def param_layouts(model: nn.Module, mesh: DeviceMesh, rules: Rules):
    """(storage, compute, grads, optimizer) placements of every parameter, by qualified name: where it is
    stored (params map), used, its reduced gradient held (grads map) and its optimizer state (optimizer map)."""
    axes = infer_axes(model)
    check_expert_layout(model, mesh, rules)
    layouts = {}
    for name, p in model.named_parameters():
        pin = get_pin(p)
        if pin is not None:
            if all(hasattr(x, "is_shard") for x in pin):
                storage = tuple(pin)
            else:
                dims = [_as_axes(e, f"P spec of {name}") for e in pin]
                storage = tuple(placements_for(mesh, dims, p.shape, f"parameter {name!r}"))
            layouts[name] = (storage,) * 4
            continue
        where = f"parameter {name!r} with axes {axes[name]}"
        compute, storage, grads, optim = (
            tuple(placements_for(mesh, rules.mesh_axes(axes[name], which, where), p.shape, f"parameter {name!r}"))
            for which in ("compute", "params", "grads", "optimizer"))
        for s, c in zip(storage, compute):
            if c.is_shard() and s != c:
                raise ValueError(f"parameter {name!r}: the params map must keep the compute sharding "
                                 f"({compute}) and only add to it, got storage {storage}")
        layouts[name] = (storage, compute, grads, optim)
    # after the shapes: a weight whose rows do not divide is named first, then heads split mid-head
    check_heads_divide(model, mesh_sizes(mesh), rules)
    return layouts


def parallelize(model: nn.Module, mesh: DeviceMesh, rules: Rules, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, input_axes=None, param_init=None,
                bucket: bool = True, master: str = "params", offload=None, bucket_mb=DEFAULT_BUCKET_MB) -> nn.Module:
    """Lays `model` out on `mesh` following `rules`, in place, and returns it.

    Plain-tensor inputs are this rank's slice of the batch (as with DDP) and, under cp, its zigzag share of the
    sequence (spmd.cp_slice); `input_axes`: their logical axes, a tuple for all or a dict from position or keyword
    (default: `batch`, the rest whole; an unnamed dim 1 is split over cp); tensors made in forward are replicated.
    A scalar (the loss), alone or in a dict, tuple or ModelOutput, comes back plain, equal on every rank.

    `bucket`: each block's parameters, and the rest as a root unit, gather in one collective per mesh axis
    (spmd.runtime.parameters.buckets), gradients reduce across blocks in `bucket_mb` MB buffers (spmd.runtime.gradients.reducer),
    data-only blocks run on local tensors (spmd.runtime.local.blocks). False (and offload="params") moves each alone.

    A model built on the meta device needs `param_init(name, meta_tensor)`: the full initial value of each meta
    parameter and buffer (once each, in `named_parameters` order); this rank keeps its slice, one full tensor at
    a time. Given a one-device build's values (`Llama.initializer(seed)`), every layout holds the same model.

    `master`: where the fp32 master weights live when `param_dtype` is lower. "params": the parameters stay
    fp32 and are cast when gathered; "optimizer": the parameters are stored in `param_dtype` and the fp32
    copy lives with the optimizer states, in the optimizer map's layout (spmd.shard_optimizer). `offload`: they
    live in host memory ("optimizer"; "nvme:DIR": files; "params": stage-3 parameter shards too, runtime.host).
    """
    if hasattr(model, STATE_ATTR):
        raise ValueError("this model is already parallelized; build a fresh model to lay it out again")
    dtensor.install()
    _refuse_foreign_checkpointing(model)
    state = SPMDState(mesh, rules, param_dtype, reduce_dtype, input_axes, master, offload)
    layouts = param_layouts(model, mesh, rules)  # every check runs before anything changes
    bucket = bucket and not _offloads_stage_3(state, layouts)
    check_param_init(model, param_init)
    check_layout_agrees(model, mesh, rules, layouts, param_dtype=param_dtype, reduce_dtype=reduce_dtype, bucket=bucket,
                        master=master, offload=offload)
    flatten_groups(mesh, rules.token_axes())  # every rank, now: sums over several axes become one collective
    converted, uses = {}, Counter()  # id(parameter) -> its laid-out parameter; -> how many modules hold it
    for mod_name, module in model.named_modules():
        for p_name, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(p) not in converted:
                converted[id(p)] = laid_out_param(p, full, layouts[full], state, param_init)
            module._parameters[p_name] = converted[id(p)]
        for b_name, b in list(module._buffers.items()):
            if b is not None and not isinstance(b, DTensor):
                full = f"{mod_name}.{b_name}" if mod_name else b_name
                module._buffers[b_name] = laid_out_buffer(b, full, state, param_init)
        uses.update(id(p) for p in module._parameters.values() if p is not None)
        hook_sets.install(module, _pre_hook(state, mod_name, module, module is model),
                       _post_hook(state, module, module is model))
    install_expert_hooks(model, state)
    for p in (p for p in converted.values() if uses[id(p)] > 1):
        p._spmd_shared = True
    if bucket:
        _install_buckets(model, state, bucket_mb)
    setattr(model, STATE_ATTR, state)
    return model


def _install_buckets(model: nn.Module, state: SPMDState, bucket_mb: float):
    state.buckets, state.bucket_of = make_buckets(model, state.mesh)
    state.local_members = local_blocks(model, state)
    for m in model.modules():
        if id(m) in state.local_members:
            hook_sets.strip_inside(m)
    whole = whole_model_members(model, state)
    if whole is not None:  # a mesh of one rank: nothing moves anywhere
        state.local_members[id(model)] = whole
    state.reducer = GradientReducer(state.mesh, bucket_mb) if bucket_mb > 0 else None


def _refuse_foreign_checkpointing(model: nn.Module) -> None:
    layers = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if layers:
        raise ValueError(f"{type(model).__name__} has transformers' activation checkpointing on (in {len(layers)} "
                         f"modules, {layers[-1] or 'the model'} among them): it recomputes each layer in backward past "
                         f"spmd's hooks, where the layer's parameters are not laid out. Turn it off "
                         f"(model.activation_checkpointing_disable(), or gradient_checkpointing_disable()) and, after "
                         f"parallelize, call spmd.apply_activation_checkpointing(model, 'full') (every_n_layers=N: "
                         f"'selective:N'; the trainer's --ac), which recomputes the same layers")


def _offloads_stage_3(state, layouts) -> bool:
    """Whether parameters live on the host (offload="params"), which needs stage-3 layouts."""
    if not host_params(state):
        return False
    for name, (storage, _, grads, optim) in layouts.items():
        if not storage == grads == optim:
            raise ValueError(f"offload='params' keeps stage-3 parameter shards on the host, but {name!r} is stored "
                             f"{storage} with gradients {grads} and optimizer state {optim}; use "
                             f"Rules.default(zero=3) (parameters sharded as their optimizer state), or "
                             f"offload='optimizer'")
    return True


def _to_dtensor(state: SPMDState, t, key):
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        return t
    def decide():
        axes = state.input_axes.get(key) if isinstance(state.input_axes, dict) else state.input_axes
        axes = axes or ("batch",) + (None,) * (t.dim() - 1)
        dims = state.rules.mesh_axes(axes, "compute", "model input", strict=False)
        if t.dim() > 1 and axes[1] is None and "cp" in state.rules.compute.get("seq", ()):
            dims[1] = ("cp",)  # the data path gives each cp rank its share of the sequence (spmd.cp_slice)
        return placements_for(state.mesh, dims, None, "model input")

    return as_dtensor(t, state.mesh, state.target(("input", key, t.dim()), decide))


def _pre_hook(state: SPMDState, name: str, module: nn.Module, is_root: bool):
    # parameters are read from the module at call time, not captured here, so that a compiled block's
    # graph takes them as inputs and serves every block of the same type
    param_names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
    kind = out_dim(module)  # 0: nn.Linear, 1: Conv1D (transposed), or an embedding / other layer
    is_linear = kind is not None and not isinstance(module, nn.Embedding)

    def hook(mod, args, kwargs):
        if state.local:  # inside a block running on local tensors (spmd.runtime.local.blocks): nothing moves here
            return None
        active.push(state)
        tags.push_module(name)
        if is_root:
            state.move_cache.clear()
            state.shared_gathers.clear()
            state.prefetched.clear()  # left over only if a forward stopped early
            if state.reducer is not None:
                state.reducer.reset()  # left over only if a backward stopped early
            local = enter_local_model(state, mod, name, args, kwargs)
            if local is not None:
                return local
            args = tuple(_to_dtensor(state, a, i) for i, a in enumerate(args))
            kwargs = {k: _to_dtensor(state, v, k) for k, v in kwargs.items()}
        else:
            local = enter_local(state, mod, name, args, kwargs)
            if local is not None:
                return local
            if not torch.compiler.is_compiling():  # (compile_blocks dresses a block before compiling it)
                hook_sets.dress_inside(mod)  # this call takes the DTensor path: the modules inside move things
        gather_block(state, mod)  # before the global view goes on: under a torch-function mode each op costs twice
        if not torch.compiler.is_compiling() and (is_root or not state.global_view):
            # the root's forward, or a checkpointed block recomputing in backward (the compiler must not read
            # the stack: its entries differ between forward and recompute, and a guard on them recompiles)
            state.global_view.append((mod, GlobalView(state)))
            state.global_view[-1][1].__enter__()
        weight_layout = None
        if is_linear and args and isinstance(args[0], DTensor):
            x, weight_layout = move_linear_input(state, name, mod._parameters["weight"], args[0], kind == 1)
            args = (x,) + tuple(args[1:])
        hooks = gather_module_params(state, mod, name, param_names, weight_layout)
        if not torch.compiler.is_compiling():  # (no hooks under the compiler; the stack's depth is not guarded)
            state.saved_hooks.append(hooks)
        return args, kwargs

    return hook


def _post_hook(state: SPMDState, module: nn.Module, is_root: bool):
    param_names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
    has_children = next(module.children(), None) is not None

    def hook(mod, args, output):
        if state.local:
            if state.local[-1].module is not mod:
                return None
            output = state.local.pop().leave(output)
            if is_root:
                output = _end_of_model(state, output)
            tags.pop_module()
            active.pop()
            return output
        compiling = torch.compiler.is_compiling()
        release_module_params(state, mod, param_names,
                              state.saved_hooks.pop() if not compiling and state.saved_hooks else None)
        if has_children:
            state.move_cache.clear()
        else:
            output = map_tensors(output, lambda t: reduce_partials(t, state.rules, mod, tags.current_module()))
        if not compiling and state.global_view and state.global_view[-1][0] is mod:
            state.global_view.pop()[1].__exit__(None, None, None)
        if is_root:
            output = _end_of_model(state, finish_output(output, tags.current_module()))
        tags.pop_module()
        active.pop()
        return output

    return hook


def _end_of_model(state: SPMDState, output):
    state.shared_gathers.clear()
    if state.sync and state.accumulating:
        if state.compiled_params:
            return reduce_after_backward(output, state)
        state.accumulating = False
    return output


class no_sync:
    """Context manager: backward passes inside leave gradients unreduced (gradient accumulation);
    the first backward outside reduces everything accumulated, once."""

    def __init__(self, model: nn.Module):
        if not hasattr(model, STATE_ATTR):
            raise ValueError("no_sync needs a model laid out by spmd.parallelize")
        self.state = getattr(model, STATE_ATTR)

    def __enter__(self):
        self.state.sync, self.state.accumulating = False, True
        return self

    def __exit__(self, *exc):
        self.state.sync = True
