"""A parameter group: parameters that move together, and every move they make (FSDP2's FSDPParamGroup). A block's
parameters and the root unit are flat groups (one buffer per mesh axis); a parameter moving alone, a group of one.
Unshard is issued one block ahead (`issue`) and finished when the block starts (`finish`); under ZeRO-3 backward
regathers once and starts the previous block's (the root unit `keep`s its values). Reduce brings the gradients, in
the reduce dtype, to the grads map's layout (gradients.layouts.reduce_gradient), a flat group's partial sums in one
collective per mesh axis and kind (or via the cross-block reducer), then back to the parameters' dtype.
"""

import torch
from torch.distributed.tensor import DTensor

from .. import collectives, tags
from ..dtensor.wrap import cast_all, cast_locals, local_of, wrap_local
from ..gradients.layouts import (
    grads_layout,
    held_for_step,
    join_unreduced,
    reduce_gradient,
    slice_onto_shards,
    summed_as_eager,
)
from ..wire.float8 import float8_weights, gather_members
from ..wire.hpz import regather_secondary
from ..wire.param import gather_on_wire
from .host import compute_device, host_params
from .reshard import BODY_COMPILED_ATTR, CHECKPOINTED_ATTR, gathers_in_graph

__all__ = ["ParamGroup", "shard_dims"]


def shard_dims(storage, compute, mesh) -> dict | None:
    """{mesh dim: tensor dim} that `storage` shards and `compute` replicates; None: a move that is not only that
    (a parameter then moves alone)."""
    dims, sharded = {}, set()
    for m, (s, c) in enumerate(zip(storage, compute)):
        if mesh.size(m) == 1:
            continue
        if s.is_shard():
            if s.dim in sharded:
                return None  # two mesh axes on one tensor dim: the order of shards matters
            sharded.add(s.dim)
        if s == c:
            continue
        if not (s.is_shard() and c.is_replicate()):
            return None
        dims[m] = s.dim
    return dims


class ParamGroup:
    """Parameters that gather and reduce together: flat (one buffer per mesh axis), or one parameter on its own."""

    def __init__(self, name: str, module, params: list, mesh, flat: bool = True, wire=None):
        self.name, self.module, self.params, self.mesh, self.flat = name, module, params, mesh, flat
        self.wire = wire  # spmd.runtime.wire.Wire: the precision the group's gathers and reductions travel in
        self.shard_dims = [shard_dims(p.placements, p._spmd_compute, mesh) for p in params] if flat else None
        assert not flat or all(d is not None for d in self.shard_dims), "flat members must pass shard_dims"
        self.next: ParamGroup | None = None  # the blocks before and after, in forward order
        self.prev: ParamGroup | None = None
        self.regathered: dict | None = None  # id(param) -> gathered DTensor, during this group's backward
        self.pending_regather = None  # a regather issued ahead, during the next block's backward
        self.keep = False  # the root unit: gathered values stay alive for backward
        self.values: dict | None = None  # id(param) -> gathered value, while its block runs forward
        self.prefetched = None  # its gather, issued while the block before ran

    def gather(self, state, grad_layouts=None, why: str | None = None) -> dict:
        """{id(param): value} in the compute layout, differentiable; prefetches the next block's. `grad_layouts`:
        local values whose gradients take those layouts. `why`: a recompute's own gather, no prefetch either way."""
        if why:
            pending = self.issue(state.param_dtype, why)
        else:
            pending, self.prefetched = self.prefetched, None
        values = _Unshard.apply(self, state, pending, grad_layouts, None, self.name, *self.params)
        nxt = self.next
        if not why and nxt is not None and nxt.prefetched is None and not gathers_in_graph(nxt.module, self.wire):
            nxt.prefetched = nxt.issue(state.param_dtype, f"gather {nxt.name} to its compute layout, prefetched")
        return {id(p): v for p, v in zip(self.params, values)}

    def unshard_one(self, state, placements, module: str) -> DTensor:
        """A group of one: its parameter in `placements` and the compute dtype, differentiable."""
        return _Unshard.apply(self, state, None, None, tuple(placements), module, *self.params)[0]

    def _moved(self, state, placements, module: str, why: str = "gather {} to its compute layout", p=None) -> DTensor:
        p = self.params[0] if p is None else p  # (detached to regather in backward)
        dtype = state.param_dtype or p.dtype
        if host_params(state):  # its shard copied to the compute device (a copy: the stored one is never read)
            x = p.to(compute_device(state.mesh), dtype, copy=True)
        else:
            x = p if p.dtype == dtype else p.to(dtype)
        if tuple(x.placements) == tuple(placements):
            return x.view_as(x) if x is p else x
        with tags.reason(module, why.format(self.params[0]._spmd_name)):
            moved = (  # (no wire, no dims to work out: this runs per parameter and step)
                None
                if state.wire is None
                else gather_on_wire(x, placements, shard_dims(x.placements, placements, self.mesh), state.wire)
            )
            return x.redistribute(placements=placements) if moved is None else moved

    def issue(self, dtype, why: str):
        """Starts the all-gather of the first mesh axis (asynchronously); `finish` completes it."""
        with torch.no_grad():
            locals_ = [local_of(p) for p in self.params]
            if dtype is not None:
                locals_ = cast_locals(locals_, dtype)
            axes = sorted({m for dims in self.shard_dims for m in dims})
            return locals_, axes, (self._launch(locals_, axes[0], why) if axes else []), why

    def _launch(self, locals_, m: int, why: str) -> list:
        launched = []
        float8 = float8_weights(self.module) if self.wire is not None and self.wire.params == "float8" else ()
        for group in _by_dtype([i for i, dims in enumerate(self.shard_dims) if m in dims], locals_):
            with tags.reason(self.name, f"{why} ({len(group)} parameters, one buffer)"):
                if float8:
                    marks = [id(self.params[i]) in float8 for i in group]
                    out = gather_members([locals_[i] for i in group], marks, self.mesh, m)
                else:
                    buffer = torch.cat([locals_[i].reshape(-1) for i in group])
                    out = collectives.all_gather_buffer(buffer, self.mesh, m, self.wire)
                launched.append((group, out))
        return launched

    def finish(self, pending) -> list[DTensor]:
        """Every parameter in its compute layout (the DTensor constructor: from_local would add an autograd node)."""
        return [
            wrap_local(local.view_as(local), self.mesh, p._spmd_compute, p.shape, p.stride())
            for p, local in zip(self.params, self.finish_local(pending))
        ]

    def finish_local(self, pending) -> list[torch.Tensor]:
        locals_, axes, launched, why = pending
        locals_ = list(locals_)
        for k, m in enumerate(axes):
            if k:
                launched = self._launch(locals_, m, why)
            n = self.mesh.size(m)
            for group, out in launched:
                chunks, dims = [[locals_[i].shape] * n for i in group], [self.shard_dims[i][m] for i in group]
                for i, whole in zip(group, collectives.unpack(collectives.wait(out).view(n, -1), chunks, dims)):
                    locals_[i] = whole
        return locals_

    def regather(self, dtype, state=None, compute=None, module: str = "", secondary=None) -> dict:
        """The parameters for this group's backward, gathered once, the previous block's regather started. A group
        of one regathers to `compute` each time it is asked, from its hpZ `secondary` shard if kept."""
        if not self.flat:  # (in the compute dtype, as `dtype` is)
            p = self.params[0]
            if secondary is not None:
                return {id(p): regather_secondary(secondary, compute, module, p._spmd_name)}
            return {id(p): self._moved(state, compute, module, "regather {} for backward", p.detach())}
        if self.regathered is None:
            pending = self.pending_regather or self.issue(dtype, f"regather {self.name} for backward")
            self.pending_regather = None
            with torch.no_grad():
                self.regathered = {id(p): v for p, v in zip(self.params, self.finish(pending))}
            prev = self.prev  # (a block under activation checkpointing regathers as it recomputes)
            if (
                prev is not None
                and prev.regathered is None
                and prev.pending_regather is None
                and not getattr(prev.module, CHECKPOINTED_ATTR, False)
            ):
                prev.pending_regather = prev.issue(dtype, f"regather {prev.name} for backward, prefetched")
        return self.regathered

    def reduce(self, grads: list, state, module: str | None = None) -> list:
        """Gradients -> the grads layout and parameters' dtype: partial sums in flat buffers or the reducer."""
        if state.reduce_dtype is not None:
            grads = cast_all(grads, state.reduce_dtype)
        if getattr(self.module, BODY_COMPILED_ATTR, False):
            grads = summed_as_eager(self.params, grads, state.rules.token_axes(), self.name)
        out, work = [None] * len(grads), {}
        # a group of one reduces on a quantized wire as a flat buffer of one member (qgZ); else through DTensor
        packs = self.flat or (self.wire is not None and self.wire.grads is not None)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            # in place (no mesh axis splits what `g` came from, nothing held back): nothing to pack
            in_place = packs and p.grad is None and tuple(g.placements) == grads_layout(p)
            if packs and state.sync and not held_for_step(p) and not in_place:
                work[i] = slice_onto_shards(join_unreduced(p, g), grads_layout(p))
                if self.flat and state.reducer is not None and self._hand_over(p, work[i], state.reducer):
                    del work[i]  # reduced with other blocks' gradients, by the end of backward
                continue
            where = (module or self.name, p._spmd_name)
            out[i] = reduce_gradient(g, grads_layout(p), held_for_step(p), not state.sync, p, where)
        if work:
            self._reduce_flat(work)
        for i, g in work.items():
            p = self.params[i]
            out[i] = reduce_gradient(g, grads_layout(p), False, False, p, (self.name, p._spmd_name))
        if host_params(state):  # in the parameter's dtype, copied to the host where it lives
            return [None if g is None else g.to(p.device, p.dtype, copy=True) for g, p in zip(out, self.params)]
        return cast_all(out, [p.dtype for p in self.params])

    def _reduce_flat(self, work: dict) -> None:
        """One reduce-scatter, then one all-reduce, per mesh axis for the partial sums in `work` (in place)."""
        mesh = self.mesh
        for kind in ("reduce-scatter", "all-reduce"):
            for m in (m for m in range(mesh.ndim) if mesh.size(m) > 1):
                members = [i for i, g in work.items() if _reduction(g, grads_layout(self.params[i]), m, mesh) == kind]
                for group in _by_dtype(members, work):
                    self._reduce_group(work, group, m, kind)

    def _hand_over(self, p, g, reducer) -> bool:
        """Gives `g` to the cross-block reducer when one reduce-scatter and/or all-reduces complete it."""
        storage, mesh = grads_layout(p), self.mesh
        kinds = {
            m: _reduction(g, storage, m, mesh)
            for m in range(mesh.ndim)
            if mesh.size(m) > 1 and g.placements[m] != storage[m]
        }
        scatter = [m for m, kind in kinds.items() if kind == "reduce-scatter"]
        if not kinds or None in kinds.values() or len(scatter) > 1:
            return False
        summed = tuple(m for m, kind in kinds.items() if kind == "all-reduce")
        reducer.add(p, g, scatter[0] if scatter else None, summed, self.name)
        return True

    def _reduce_group(self, work: dict, group: list, m: int, kind: str):
        mesh, tensors = self.mesh, [local_of(work[i]) for i in group]
        what = (
            f"gradients of {self.name} ({len(group)} parameters, one buffer)"
            if self.flat
            else f"gradient of {self.name}"
        )
        with tags.reason(self.name, f"{kind} {what}"):
            if kind == "reduce-scatter":
                dims = [grads_layout(self.params[i])[m].dim for i in group]
                pending = collectives.reduce_scatter(tensors, dims, mesh, m, self.wire)
            else:
                pending = collectives.all_reduce(tensors, mesh, m, self.wire)
        for i, reduced in zip(group, pending.results()):
            g, storage = work[i], grads_layout(self.params[i])
            placements = [storage[k] if k == m else x for k, x in enumerate(g.placements)]
            work[i] = wrap_local(reduced, mesh, placements, g.shape, g.stride())


def _reduction(g, target, m: int, mesh) -> str | None:
    """The one collective over mesh dim `m` that takes `g`'s placement there to `target`'s. Not a reduce-scatter
    onto a tensor dim an inner mesh dim already splits: its rows would be that axis's chunk's, not DTensor's."""
    current, storage, n = g.placements[m], target[m], mesh.size(m)
    if not (current.is_partial() and getattr(current, "reduce_op", "sum") == "sum"):
        return None
    if storage.is_shard():
        inner = [x for k, x in enumerate(g.placements) if k > m and mesh.size(k) > 1 and x.is_shard(storage.dim)]
        return "reduce-scatter" if local_of(g).shape[storage.dim] % n == 0 and not inner else None
    return "all-reduce" if storage.is_replicate() else None


def _by_dtype(members: list, tensors) -> list[list]:
    groups: dict = {}
    for i in members:
        groups.setdefault(tensors[i].dtype, []).append(i)
    return list(groups.values())


class _Unshard(torch.autograd.Function):
    """A group's gather: its values in forward, its reduction in backward (one autograd node per group)."""

    @staticmethod
    def forward(ctx, group: ParamGroup, state, pending, grad_layouts, placements, module: str, *params):
        ctx.group, ctx.state, ctx.grad_layouts, ctx.module = group, state, grad_layouts, module
        ctx.set_materialize_grads(False)  # a value the block did not use (its module moved it itself) gets None
        if not group.flat:
            return (group._moved(state, placements, module),)
        pending = pending or group.issue(state.param_dtype, f"gather {group.name} to its compute layout")
        if grad_layouts is None:
            return tuple(group.finish(pending))
        return tuple(t.view_as(t) for t in group.finish_local(pending))

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        group.regathered = group.pending_regather = None  # the block's backward is done with its regathered values
        if ctx.grad_layouts is not None:
            grads = [
                None if g is None else wrap_local(g, group.mesh, layout, p.shape, g.stride())
                for g, p, layout in zip(grads, group.params, ctx.grad_layouts)
            ]
        return (None,) * 6 + tuple(group.reduce(list(grads), ctx.state, ctx.module))
