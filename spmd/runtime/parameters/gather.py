"""How a module's parameters reach their compute layout before it runs, and leave after; every move is a
parameter group's (spmd.runtime.parameters.group), chosen here once per module call: with its block
(`gather_block`, one collective per mesh axis; with comm also a compiled block's, whose graph takes the values);
one by one (`gather_param`, a group of one; a shared parameter gathers once per forward); inside a compiled
block, as DTensor's redistribute under a recompute-in-backward policy (ZeRO-3's regather), or where gradients do
not simply reduce to the storage layout (ZeRO-1/2, accumulation) a function whose backward is the groups'
reduction. After forward the gathered parameters are dropped and regathered for backward (ZeRO-3,
spmd.runtime.parameters.reshard) unless checkpointed. `compiling` (whether the compiler traces) is the hooks'.
"""

import functools

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..gradients.layouts import grads_layout, held_for_step, reduce_gradient
from ..state import tracing
from ..wire.hpz import keep_secondary
from .group import ParamGroup
from .reshard import BODY_COMPILED_ATTR, CHECKPOINTED_ATTR, reshard_after_forward, storage_key

__all__ = [
    "gather_param",
    "gather_block",
    "gather_module_params",
    "release_module_params",
    "gather_shared",
    "gathered_param",
    "place_for_graph",
    "regathering_group",
]


def gather_param(state, p, placements, module: str) -> DTensor:
    """`p` in `placements` and the compute dtype, differentiable: its gradient is reduced in backward."""
    if tracing():
        # While micro-batches accumulate (the compiler guards on the flag: one graph each way) the gradient stays
        # unreduced, and the last micro-batch's backward reduces the sum (spmd.runtime.gradients.accumulate).
        args = (p, tuple(placements), state.param_dtype, state.reduce_dtype, state.accumulating)
        return checkpoint(_redistribute_param, *args, use_reentrant=False, context_fn=_recompute_in_backward)
    return single_group(state, p).unshard_one(state, placements, module)


def _redistribute_param(p, placements, dtype, reduce_dtype, unreduced):
    if unreduced or held_for_step(p) or grads_layout(p) != tuple(p.placements):
        return _CompiledGather.apply(p, placements, dtype, reduce_dtype, unreduced)
    return p.redistribute(placements=placements, forward_dtype=dtype, backward_dtype=reduce_dtype)


class _CompiledGather(torch.autograd.Function):
    """The compiled move of a parameter whose gradient does not simply reduce to its storage layout: its
    backward leaves the gradient unreduced while micro-batches accumulate, and otherwise reduces it to the
    grads map's layout (ZeRO-2: a reduce-scatter onto the optimizer's shards) or, for a step that reduces
    it (ZeRO-1), only over the axes the grads map shards (spmd.runtime.gradients.layouts.reduce_gradient)."""

    @staticmethod
    def forward(ctx, p: DTensor, placements, dtype, reduce_dtype, unreduced: bool):
        ctx.grads, ctx.held, ctx.reduce_dtype, ctx.dtype = grads_layout(p), held_for_step(p), reduce_dtype, p.dtype
        ctx.unreduced = unreduced
        return p.redistribute(placements=placements, forward_dtype=dtype)

    @staticmethod
    def backward(ctx, g: DTensor):
        if ctx.reduce_dtype is not None and g.dtype != ctx.reduce_dtype:
            g = g.to(ctx.reduce_dtype)
        # partial sums stay partial when held (the compiler traces this first with a replicated guess)
        g = reduce_gradient(g, ctx.grads, ctx.held, ctx.unreduced)
        return g.to(ctx.dtype), None, None, None, None


# ZeRO-3 under the compiler: the gathered parameter is recomputed (regathered) in backward, not saved
_recompute_in_backward = functools.partial(
    create_selective_checkpoint_contexts, lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE
)


def gather_block(state, mod, compiling: bool) -> dict | None:
    """Gathers the flat group of `mod`, if it is a block's, for its modules to find (eager only). With comm a
    compiled block's group gathers here, for its graph to take; returns what backward regathers of it."""
    body = getattr(mod, BODY_COMPILED_ATTR, False)
    group = None if compiling or (body and state.wire is None) else state.groups.get(id(mod))
    if group is None:
        return None
    group.values = group.gather(state)
    if body:
        place_for_graph(mod, group.values)
    return {
        storage_key(group.values[id(p)]): (p, p._spmd_compute, group, None)
        for p in group.params
        if body and moves_data(p.placements, p._spmd_compute, state.mesh)
    }


def place_for_graph(block, values: dict, release: bool = False) -> None:
    """Puts a group's gathered `values` ({id(param): value}) where the modules of `block`'s compiled graph read
    their parameters (`__dict__`, which the graph takes as inputs: no guard on the block). `release`: points those
    names back at the parameters, as the graph does when it runs to its end (a recompute that checkpointing stops
    at its last saved tensor never gets there)."""
    for m in block.modules():
        m.__dict__.update({n: p if release else values[id(p)] for n, p in m._parameters.items() if id(p) in values})


def gather_module_params(state, mod, name: str, param_names, weight_layout, compiling: bool, regather=None):
    """Puts `mod`'s parameters, in their compute layout, where attribute lookup finds them first
    (`mod.__dict__`), and returns the saved-tensor hooks that drop them (and `regather`'s) after forward, or None.
    `weight_layout` overrides the compute layout of `mod.weight` (a linear layer's decision)."""
    regather = dict(regather or {})
    for p_name in param_names:
        p = mod._parameters[p_name]
        compute = weight_layout if (weight_layout is not None and p_name == "weight") else p._spmd_compute
        placed = mod.__dict__.get(p_name) if compiling and compute is p._spmd_compute else None
        use = placed is not None and placed is not p  # put there by its compiled block's hooks (gather_block)
        g = mod.__dict__[p_name] = placed if use else gathered_param(state, p, compute, name, compiling)
        group = None if compiling or not moves_data(p.placements, compute, state.mesh) else regathering_group(state, p)
        if group is not None and not group.keep:  # the root unit keeps its values from forward
            # hpZ: a group of one's backward regathers from a secondary shard kept now, inside its axis
            secondary = None if group.flat else keep_secondary(g, p, compute, state.wire)
            regather[storage_key(g)] = (p, compute, group, secondary)
    if not regather or compiling or getattr(mod, CHECKPOINTED_ATTR, False):
        return None
    hooks = reshard_after_forward(regather, state, name)
    hooks.__enter__()
    return hooks


def gather_shared(state, p, compute, module: str) -> DTensor:
    """`p` in layout `compute`, gathered once per forward however many modules use it (its gradient
    contributions then sum before one reduction)."""
    key = (id(p), tuple(compute))
    if key not in state.shared_gathers:
        state.shared_gathers[key] = gather_param(state, p, compute, module)
    return state.shared_gathers[key]


def gathered_param(state, p, compute, module: str, compiling: bool) -> DTensor:
    """`p` in `compute` for `module`: a shared parameter's one gather, its group's value while its block runs
    (eager), or a group of one."""
    if getattr(p, "_spmd_shared", False):
        return gather_shared(state, p, compute, module)
    group = None if compiling or compute is not p._spmd_compute else state.group_of.get(id(p))
    if group is not None and group.values:  # gathered with its block (the compiler: no guard on it)
        return group.values[id(p)]
    return gather_param(state, p, compute, module)


def release_module_params(state, mod, param_names, hooks, compiling: bool):
    """After `mod`'s forward: its gathered parameters leave the module (and its group's values the state)."""
    group = None if compiling else state.groups.get(id(mod))
    if group is not None:
        group.values = None
    if hooks is not None:
        hooks.__exit__(None, None, None)
    for n in param_names:
        if compiling:  # torch 2.11's compiler cannot trace removing a module's attribute; pointing the name back
            mod.__dict__[n] = mod._parameters[n]  # at the stored parameter drops the gathered tensor the same way
        else:
            mod.__dict__.pop(n, None)


def regathering_group(state, p) -> ParamGroup:
    """The group that regathers `p` for backward: its flat group's, else its group of one."""
    return state.group_of.get(id(p)) or single_group(state, p)


def single_group(state, p) -> ParamGroup:
    """`p`'s group of one, made at its first move and kept: its gathers and regathers all go through it."""
    if id(p) not in state.singles:
        state.singles[id(p)] = ParamGroup(p._spmd_name, None, [p], state.mesh, flat=False, wire=state.wire)
    return state.singles[id(p)]


def moves_data(storage, compute, mesh) -> bool:
    """Whether a parameter stored in `storage` moves data to reach `compute` (a mesh axis of size > 1 differs)."""
    return any(s != c and mesh.size(i) > 1 for i, (s, c) in enumerate(zip(storage, compute)))
