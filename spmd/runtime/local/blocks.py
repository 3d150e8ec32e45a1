"""Blocks whose compute layout is data-only run on local tensors, as DDP and FSDP2 run theirs.

A repeated block with everything replicated in compute, fed batch-split activations, computes on each rank exactly
its batch slice's share: no op needs DTensor's dispatch. It gathers its bucket, runs on local tensors, and its
outputs go back into DTensors; gradients keep their layouts across (edges). Checkpointed, compiled, expert and
float8 blocks keep the DTensor path. The root unit's leaf layers run the same way.
"""

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...layout.annotate import computes_in_float8, get_axes
from ..dtensor.stack import resume, suspend_top
from ..dtensor.wrap import local_of
from ..experts.dispatch import EXPERTS, expert_modules
from ..experts.whole_experts import routes_itself
from ..parameters.gather import gathered_param, moves_data, regathering_group
from ..parameters.reshard import CHECKPOINTED_ATTR, reshard_after_forward, storage_key
from .edges import batch_grad_layout, to_local, wrap_outputs

__all__ = ["local_blocks", "enter_local", "LocalBlock", "whole_members"]


def local_blocks(model, state) -> dict:
    """{id(module): members} of blocks and root-unit leaves replicated in compute, without experts, and self-routers."""
    mesh = state.mesh
    experts = {id(m): m for m in expert_modules(model).values()}
    found = {}
    for m in experts.values():
        # under ep each rank computes with its E/ep experts (spmd.runtime.experts.routed_dispatch sends their tokens)
        members = whole_members([m], mesh, experts_over="ep") if routes_itself(m) else None
        if members is not None:
            found[id(m)] = members
            setattr(m, _INSIDE_ATTR, True)
    for bucket in state.groups.values():
        if bucket.module is model:
            continue  # the root unit: the model itself, whose inputs and outputs are not a block's
        if any(id(m) in experts for m in bucket.module.modules()):
            continue
        members = whole_members(bucket.module.modules(), mesh)
        if members is not None:
            found[id(bucket.module)] = members
    root = state.groups.get(id(model))
    if root is not None:
        rooted = {id(p) for p in root.params}
        for m in model.modules():
            if next(m.children(), None) is not None or id(m) in experts:
                continue
            members = whole_members([m], mesh)
            if (
                members
                and members[0]
                and all(id(p) in rooted or getattr(p, "_spmd_shared", False) for _, _, p in members[0])
            ):
                found[id(m)] = members
    return found


def whole_members(modules, mesh, experts_over: str | None = None) -> tuple | None:
    """(parameters, buffers, {}) of `modules` as (module, name, tensor) when all are replicated in compute (or split
    on their leading `experts` dim over `experts_over`); else None."""
    params, buffers = [], []
    for m in modules:
        if computes_in_float8(m):
            return None  # its scales are maxima over the whole batch: DTensor's path reduces them across ranks
        params += [(m, n, p) for n, p in m._parameters.items() if isinstance(p, DTensor)]
        buffers += [(m, n, b) for n, b in m._buffers.items() if isinstance(b, DTensor)]
    split = mesh.mesh_dim_names.index(experts_over) if experts_over in (mesh.mesh_dim_names or ()) else None

    def whole(t, layout) -> bool:
        experts = split is not None and (get_axes(t) or (None,))[0] == EXPERTS
        return all(
            c.is_replicate() or mesh.size(i) == 1 or (experts and i == split and c == Shard(0))
            for i, c in enumerate(layout)
        )

    replicated = all(whole(p, p._spmd_compute) for _, _, p in params) and all(
        whole(b, b.placements) for _, _, b in buffers
    )
    return (params, buffers, {}) if replicated else None


def _batch_layout(args, kwargs, state) -> tuple | None:
    """The first DTensor input's placements if split on dim 0 at most and the others alike or whole, though not whole
    along the batch it splits (a mask made from global shapes, DTensor or plain: DTensor slices it); else None."""
    mesh = state.mesh
    layout, whole = None, []
    for t in _dtensors(args, kwargs):
        if t.device_mesh is not mesh and t.device_mesh != mesh:
            return None
        # Replicate on the mesh axes of size 1, where a split splits nothing: decided once per layout
        placements = state.target(
            ("active axes", t.placements),
            lambda p=t.placements: tuple(Replicate() if mesh.size(i) == 1 else q for i, q in enumerate(p)),
        )
        if layout is None:
            if not all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in placements):
                return None
            layout, first = placements, t
        elif placements != layout and not all(p.is_replicate() for p in placements):
            return None
        elif placements != layout:
            whole.append(t)
    if layout is None or not first.ndim or not any(q.is_shard() for q in layout):
        return layout
    whole += [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)]
    return None if any(t.ndim and t.shape[0] == first.shape[0] for t in whole) else layout


def _dtensors(args, kwargs) -> list:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            found.extend(x for x in a if isinstance(x, DTensor))
    return found


class LocalBlock:
    """One call of a data-only block on local tensors: `enter` before its forward, `leave` after."""

    def __init__(self, state, module, name: str, members: tuple, layout: tuple, mode=None):
        self.state, self.module, self.name, self.layout = state, module, name, layout
        self.members, self.buffers, self.facts = members
        self.split = tuple(p.is_shard() for p in layout)
        self.mode = mode  # the global view, off the mode stack until `leave`
        self.hooks = None
        self.batch = None

    def enter(self, args, kwargs):
        """Gathers the block's parameters into its modules as local tensors; returns the local inputs."""
        state = self.state
        bucket = state.groups.get(id(self.module))  # None: a layer of the root unit, gathered as the model began
        grad_layouts, regathered = self.facts.get(self.split) or self._facts(bucket)
        self.place({} if bucket is None else bucket.gather(state, grad_layouts))
        regather = {
            storage_key(m.__dict__[n]): (p, p._spmd_compute, group, None)
            for (m, n, p), group in zip(self.members, regathered)
            if group is not None
        }
        if regather and not getattr(self.module, CHECKPOINTED_ATTR, False):
            self.hooks = reshard_after_forward(regather, state, self.name)
            self.hooks.__enter__()
        first = next(iter(_dtensors(args, kwargs)))
        self.batch = (local_of(first).shape[0] if first.ndim else None, first.shape[0] if first.ndim else None)
        return (tuple(to_local(a, self.split) for a in args), {k: to_local(v, self.split) for k, v in kwargs.items()})

    def leave(self, output):
        """Drops the local parameters and wraps the block's tensor outputs back into DTensors."""
        try:
            if self.hooks is not None:
                self.hooks.__exit__(None, None, None)
            self.drop_values()
            return wrap_outputs(output, self.state.mesh, self.layout, self.batch)
        finally:
            resume(self.mode)

    def value(self, gathered: dict, p) -> torch.Tensor:
        """`p`'s local value: from `gathered` (its group's), else as a module's parameter outside its group."""
        local = gathered.get(id(p))
        if local is not None:
            return local
        return to_local(gathered_param(self.state, p, p._spmd_compute, self.name, False), self.split)

    def _facts(self, bucket) -> tuple:
        """(gradient layouts, regathering group per member) for this batch split: fixed, so worked out once and kept."""
        split, mesh = self.split, self.state.mesh
        layouts = None if bucket is None else [batch_grad_layout(p._spmd_compute, split) for p in bucket.params]
        groups = [regathering_group(self.state, p) for _, _, p in self.members]
        regathered = [
            g if moves_data(p.placements, p._spmd_compute, mesh) and not g.keep else None
            for g, (_, _, p) in zip(groups, self.members)
        ]
        self.facts[split] = (layouts, regathered)
        return layouts, regathered

    def place(self, values: dict) -> None:
        """Each member's local value (`value`) and the modules' own buffers (rotary tables, an embedding's scale) as
        local tensors, in their modules."""
        for m, n, p in self.members:
            m.__dict__[n] = self.value(values, p)
        for m, n, b in self.buffers:
            m.__dict__[n] = b.to_local() if b.requires_grad else local_of(b)

    def drop_values(self) -> None:
        """Takes the local parameters and buffers out of the modules: their DTensors show through again."""
        for m, n, _ in (*self.members, *self.buffers):
            m.__dict__.pop(n, None)


_INSIDE_ATTR = "_spmd_local_inside"  # on a module that runs on local tensors inside its block's forward


def enter_local(state, mod, name: str, args, kwargs):
    """(args, kwargs) on local tensors when `mod` is a data-only block fed batch-split inputs (pushed); else None."""
    # a checkpointed block recomputes past its own hooks; a module inside it runs its hooks again
    if getattr(mod, CHECKPOINTED_ATTR, False) and not getattr(mod, _INSIDE_ATTR, False):
        return None
    members = state.local_members.get(id(mod))
    if members is None:
        return None
    # the global view leaves the mode stack until the block's exit: with no DTensor inside it would only see every op
    mode = suspend_top(state.global_view[-1][1]) if state.global_view else None
    try:
        layout = _batch_layout(args, kwargs, state)
        if layout is None:
            resume(mode)
            return None
        call = LocalBlock(state, mod, name, members, layout, mode)
        out = call.enter(args, kwargs)
    except BaseException:
        resume(mode)
        raise
    state.local.append(call)
    return out
