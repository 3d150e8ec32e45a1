"""`parallelize(model, mesh, rules)`: lays a global-view model out on a mesh, in place.

Parameters become DTensors in their storage layout; hooks on the modules (spmd.runtime.hooks) then run the
propagation pass as the model runs.
"""

from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..layout.annotate import computes_in_float8, get_pin, infer_axes
from ..layout.heads import check_heads_divide
from ..layout.mesh import flatten_groups, mesh_sizes
from ..layout.rules import Rules, _as_axes, placements_for
from . import dtensor
from .activations.kv_cache import refuse_generate, skip_cache_in_training
from .consistency import check_layout_agrees
from .experts.dispatch import check_expert_layout, install_expert_hooks
from .gradients.reducer import DEFAULT_BUCKET_MB, GradientReducer
from .hooks import module_hooks
from .local import hook_sets
from .local.blocks import local_blocks
from .local.whole_model import whole_model_members
from .parameters.buckets import make_buckets
from .parameters.host import host_params
from .parameters.reshard import BODY_COMPILED_ATTR, gathers_in_graph
from .parameters.storage import check_param_init, laid_out_buffer, laid_out_param
from .state import STATE_ATTR, SPMDState
from .wire import wire_setting

__all__ = ["parallelize", "no_sync", "param_layouts"]


def param_layouts(model: nn.Module, mesh: DeviceMesh, rules: Rules):
    """(storage, compute, grads, optimizer) placements of every parameter, by qualified name."""
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
            for which in ("compute", "params", "grads", "optimizer")
        )
        for s, c in zip(storage, compute):
            if c.is_shard() and s != c:
                raise ValueError(
                    f"parameter {name!r}: the params map must keep the compute sharding "
                    f"({compute}) and only add to it, got storage {storage}"
                )
        layouts[name] = (storage, compute, grads, optim)
    # after the shapes: a weight whose rows do not divide is named first, then heads split mid-head
    check_heads_divide(model, mesh_sizes(mesh), rules)
    return layouts


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    rules: Rules,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    input_axes=None,
    param_init=None,
    bucket: bool = True,
    master: str = "params",
    offload=None,
    bucket_mb=DEFAULT_BUCKET_MB,
    comm: dict | None = None,
) -> nn.Module:
    """Lays `model` out on `mesh` following `rules`, in place, and returns it (docs/layouts-and-rules.md).
    Plain-tensor inputs are this rank's slice of the batch (as with DDP; under cp its zigzag share of the
    sequence, spmd.cp_slice); `input_axes` names their logical axes (a tuple, or a dict by position or keyword;
    default `batch`, the rest whole). A scalar output (the loss) comes back plain, equal on every rank.
    `bucket`: blocks and the root unit gather in one collective per mesh axis, gradients reduce across blocks in
    `bucket_mb` MB buffers, data-only blocks run on local tensors; False (and offload="params") moves each alone.
    `param_init(name, meta_tensor)`: the full initial value of each meta parameter and buffer, once each, in order.
    `master`: where fp32 master weights live under a lower `param_dtype` ("params": cast when gathered;
    "optimizer": with the optimizer states). `offload`: "optimizer", "nvme:DIR" or "params" (docs/zero-and-offload.md).
    `comm`: the wire precision of gathers and reductions (ZeRO++, docs/compression.md)."""
    if hasattr(model, STATE_ATTR):
        raise ValueError("this model is already parallelized; build a fresh model to lay it out again")
    dtensor.install()
    _refuse_foreign_checkpointing(model)
    state = SPMDState(mesh, rules, param_dtype, reduce_dtype, input_axes, master, offload)
    compiled = any(gathers_in_graph(m) or getattr(m, BODY_COMPILED_ATTR, False) for m in model.modules())
    float8 = any(computes_in_float8(m) for m in model.modules())
    state.wire = wire_setting(comm, tuple(mesh.mesh_dim_names or ()), compiled, float8)
    layouts = param_layouts(model, mesh, rules)  # every check runs before anything changes
    bucket = bucket and not _offloads_stage_3(state, layouts)
    check_param_init(model, param_init)
    check_layout_agrees(
        model,
        mesh,
        rules,
        layouts,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        bucket=bucket,
        master=master,
        offload=offload,
    )
    flatten_groups(mesh, rules.token_axes())  # every rank, now: sums over several axes become one collective
    _lay_out_tensors(model, state, layouts, param_init)
    if bucket:
        _install_buckets(model, state, bucket_mb)
    setattr(model, STATE_ATTR, state)
    return model


def _lay_out_tensors(model: nn.Module, state: SPMDState, layouts: dict, param_init) -> None:
    """Every parameter and buffer in its storage layout, in place, and the pass's hooks on every module."""
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
        hook_sets.install(module, *module_hooks(state, mod_name, module, module is model))
    install_expert_hooks(model, state)
    skip_cache_in_training(model)
    refuse_generate(model)
    for p in (p for p in converted.values() if uses[id(p)] > 1):
        p._spmd_shared = True


def _install_buckets(model: nn.Module, state: SPMDState, bucket_mb: float):
    state.groups, state.group_of = make_buckets(model, state.mesh, state.wire)
    state.local_members = local_blocks(model, state)
    for m in model.modules():
        if id(m) in state.local_members:
            hook_sets.strip_inside(m)
    whole = whole_model_members(model, state)
    if whole is not None:  # a mesh of one rank: nothing moves anywhere
        state.local_members[id(model)] = whole
    state.reducer = GradientReducer(state.mesh, bucket_mb, state.wire) if bucket_mb > 0 else None


def _refuse_foreign_checkpointing(model: nn.Module) -> None:
    layers = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if layers:
        raise ValueError(
            f"{type(model).__name__} has transformers' activation checkpointing on (in {len(layers)} "
            f"modules, {layers[-1] or 'the model'} among them): it recomputes each layer in backward past "
            f"spmd's hooks, where the layer's parameters are not laid out. Turn it off "
            f"(model.activation_checkpointing_disable(), or gradient_checkpointing_disable()) and, after "
            f"parallelize, call spmd.apply_activation_checkpointing(model, 'full') (every_n_layers=N: "
            f"'selective:N'; the trainer's --ac), which recomputes the same layers"
        )


def _offloads_stage_3(state, layouts) -> bool:
    """Whether parameters live on the host (offload="params"), which needs stage-3 layouts."""
    if not host_params(state):
        return False
    for name, (storage, _, grads, optim) in layouts.items():
        if not storage == grads == optim:
            raise ValueError(
                f"offload='params' keeps stage-3 parameter shards on the host, but {name!r} is stored "
                f"{storage} with gradients {grads} and optimizer state {optim}; use "
                f"Rules.default(zero=3) (parameters sharded as their optimizer state), or "
                f"offload='optimizer'"
            )
    return True


class no_sync:
    """Context manager: backwards inside leave gradients unreduced; the first backward outside reduces them once."""

    def __init__(self, model: nn.Module):
        if not hasattr(model, STATE_ATTR):
            raise ValueError("no_sync needs a model laid out by spmd.parallelize")
        self.state = getattr(model, STATE_ATTR)

    def __enter__(self):
        self.state.sync, self.state.accumulating = False, True
        return self

    def __exit__(self, *exc):
        self.state.sync = True
