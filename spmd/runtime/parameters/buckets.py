"""Bucketed parameter gathers and gradient reductions: one collective per block and mesh axis, not one per
parameter (the flat buffers of FSDP2 and DDP).

Before a block runs forward, the parameters of the block whose compute layout only un-shards dims of their
storage layout are gathered together: per mesh axis, their local shards are flattened into one buffer, that
buffer is all-gathered, and the result is cut back into per-parameter tensors. In backward the block's
gradients are reduced the same way: one reduce-scatter per mesh axis for partial sums bound for shards
(FSDP), then one all-reduce per mesh axis for partial sums that stay replicated (DP, HSDP's dp axis,
sequence-parallel norm weights). Under ZeRO-3 the backward regathers the whole bucket once, on the first
saved tensor it needs. Layouts the buckets do not cover move per parameter, as in spmd.runtime.parameters.gather;
compiled blocks leave all of this to the compiler.
"""

import torch
from torch.distributed.tensor import DTensor

from ...layout.blocks import find_blocks
from .. import collectives, tags
from ..dtensor.wrap import cast_all, cast_locals, local_of, wrap_local
from ..gradients.layouts import (
    grads_layout,
    held_for_step,
    join_unreduced,
    reduce_for_step,
    reduce_to,
    slice_onto_shards,
)
from .reshard import CHECKPOINTED_ATTR, gathers_in_graph

__all__ = ["Bucket", "make_buckets", "drop_root_unit", "gather_bucket", "regather_for_recompute", "shard_dims"]


def shard_dims(p, mesh) -> dict | None:
    """{mesh dim: tensor dim} that p's storage shards and its compute layout replicates, or None when the
    move is anything else (the parameter then moves on its own)."""
    dims, sharded = {}, set()
    for m, (s, c) in enumerate(zip(p.placements, p._spmd_compute)):
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


class Bucket:
    """The parameters of one block that gather and reduce together."""

    def __init__(self, name: str, module, params: list, mesh):
        self.name, self.module, self.params, self.mesh = name, module, params, mesh
        self.shard_dims = [shard_dims(p, mesh) for p in params]
        assert all(d is not None for d in self.shard_dims), "bucket members must pass shard_dims"
        self.next: Bucket | None = None  # the blocks before and after, in forward order
        self.prev: Bucket | None = None
        self.regathered: dict | None = None  # id(param) -> gathered DTensor, during this bucket's backward
        self.pending_regather = None  # a regather issued ahead, during the next block's backward
        self.keep = False  # the root unit: gathered values stay alive for backward
        self.wire = None  # spmd.runtime.wire.Wire: the precision the gathers travel in

    def issue(self, dtype, why: str):
        """Starts the all-gather of the first mesh axis (asynchronous); `finish` completes the gather. Issued
        one block ahead, it runs while the previous block computes (FSDP2's prefetch)."""
        with torch.no_grad():
            locals_ = [local_of(p) for p in self.params]
            if dtype is not None:
                locals_ = cast_locals(locals_, dtype)
            axes = sorted({m for dims in self.shard_dims for m in dims})
            return locals_, axes, (self._launch(locals_, axes[0], why) if axes else []), why

    def _launch(self, locals_, m: int, why: str) -> list:
        launched = []
        for group in _by_dtype([i for i, dims in enumerate(self.shard_dims) if m in dims], locals_):
            buffer = torch.cat([locals_[i].reshape(-1) for i in group])
            with tags.reason(self.name, f"{why} ({len(group)} parameters, one buffer)"):
                launched.append((group, collectives.all_gather_buffer(buffer, self.mesh, m, self.wire)))
        return launched

    def finish(self, pending) -> list[DTensor]:
        """Every parameter in its compute layout (cast to the dtype `issue` got): one all-gather per mesh axis."""
        # the DTensor constructor itself: from_local's autograd function would be a node for nothing here
        return [
            wrap_local(local.view_as(local), self.mesh, p._spmd_compute, p.shape, p.stride())
            for p, local in zip(self.params, self.finish_local(pending))
        ]

    def finish_local(self, pending) -> list[torch.Tensor]:
        """`finish`'s values as this rank's local tensors."""
        locals_, axes, launched, why = pending
        locals_ = list(locals_)
        for k, m in enumerate(axes):
            if k:
                launched = self._launch(locals_, m, why)
            n = self.mesh.size(m)
            for group, out in launched:
                out = collectives.wait(out).view(n, -1)
                offset = 0
                for i in group:
                    t = locals_[i]
                    pieces = [out[r, offset : offset + t.numel()].view(t.shape) for r in range(n)]
                    locals_[i] = torch.cat(pieces, dim=self.shard_dims[i][m])
                    offset += t.numel()
        return locals_

    def regather(self, dtype) -> dict:
        """The parameters for this bucket's backward, gathered once (or finished, when prefetched), and the
        previous block's regather started so it runs during this block's backward."""
        if self.regathered is None:
            pending = self.pending_regather or self.issue(dtype, f"regather {self.name} for backward")
            self.pending_regather = None
            with torch.no_grad():
                values = self.finish(pending)
            self.regathered = {id(p): v for p, v in zip(self.params, values)}
            prev = self.prev
            if prev is not None and prev.regathered is None and prev.pending_regather is None and prev.reshards():
                prev.pending_regather = prev.issue(dtype, f"regather {prev.name} for backward, prefetched")
        return self.regathered

    def reshards(self) -> bool:
        """Whether this block's backward regathers (not under activation checkpointing)."""
        return not getattr(self.module, CHECKPOINTED_ATTR, False)

    def reduce(self, grads: list, state) -> list:
        """Gradients (compute layout) -> storage layout in the reduce dtype, bucketed per mesh axis."""
        mesh = self.mesh
        work = {}
        out = [None] * len(grads)
        if state.reduce_dtype is not None:
            grads = cast_all(grads, state.reduce_dtype)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            # under no_sync, or where no mesh axis splits what the gradient was computed from: nothing to reduce
            if not state.sync or (p.grad is None and tuple(g.placements) == grads_layout(p)):
                out[i] = g
                continue
            if held_for_step(p):
                with tags.reason(self.name, f"reduce gradient of {p._spmd_name} but over the axes its step shards"):
                    out[i] = reduce_for_step(p, g)
                continue
            work[i] = slice_onto_shards(join_unreduced(p, g), grads_layout(p))
            if state.reducer is not None and self._hand_over(p, work[i], state.reducer):
                del work[
                    i
                ]  # reduced with other blocks' gradients, by the end of backward (spmd.runtime.gradients.reducer)
        for kind in ("reduce_scatter", "all_reduce"):
            for m in (m for m in range(mesh.ndim) if mesh.size(m) > 1):
                members = [
                    i
                    for i, g in work.items()
                    if _bucketable(g.placements[m], grads_layout(self.params[i])[m], kind, work[i], mesh.size(m))
                ]
                for group in _by_dtype(members, {i: local_of(work[i]) for i in members}):
                    self._reduce_group(work, group, m, kind, state)
        for i, g in work.items():
            storage = grads_layout(self.params[i])
            if tuple(g.placements) != storage:
                with tags.reason(self.name, f"reduce gradient of {self.params[i]._spmd_name} to its storage layout"):
                    g = reduce_to(g, storage)
            out[i] = g
        return cast_all(out, [p.dtype for p in self.params])

    def _hand_over(self, p, g, reducer) -> bool:
        """Gives `g` to the cross-block reducer when a reduce-scatter over one mesh axis and an all-reduce over
        the others that replicate it (either may be absent) complete it."""
        storage = grads_layout(p)
        scatter, summed = [], []
        for m in range(self.mesh.ndim):
            n = self.mesh.size(m)
            if n == 1 or g.placements[m] == storage[m]:
                continue
            if _bucketable(g.placements[m], storage[m], "reduce_scatter", g, n):
                scatter.append(m)
            elif _bucketable(g.placements[m], storage[m], "all_reduce", g, n):
                summed.append(m)
            else:
                return False
        if len(scatter) > 1 or not (scatter or summed):
            return False
        reducer.add(p, g, scatter[0] if scatter else None, tuple(summed), self.name)
        return True

    def _reduce_group(self, work: dict, group: list, m: int, kind: str, state):
        mesh, what = self.mesh, f"gradients of {self.name} ({len(group)} parameters, one buffer)"
        tensors = [local_of(work[i]) for i in group]
        if kind == "reduce_scatter":
            with tags.reason(self.name, f"reduce-scatter {what}"):
                pending = collectives.reduce_scatter(
                    tensors, [grads_layout(self.params[i])[m].dim for i in group], mesh, m, state.wire
                )
        else:
            with tags.reason(self.name, f"all-reduce {what}"):
                pending = collectives.all_reduce(tensors, mesh, m, state.wire)
        for i, reduced in zip(group, pending.results()):
            g = work[i]
            placements = list(g.placements)
            placements[m] = grads_layout(self.params[i])[m]
            work[i] = DTensor.from_local(
                reduced, mesh, tuple(placements), run_check=False, shape=g.shape, stride=g.stride()
            )


def _bucketable(current, storage, kind: str, g, n: int) -> bool:
    if not (current.is_partial() and getattr(current, "reduce_op", "sum") == "sum"):
        return False
    if kind == "reduce_scatter":
        return storage.is_shard() and local_of(g).shape[storage.dim] % n == 0
    return storage.is_replicate()


def _by_dtype(members: list, tensors) -> list[list]:
    groups: dict = {}
    for i in members:
        groups.setdefault(tensors[i].dtype, []).append(i)
    return list(groups.values())


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bucket: Bucket, state, pending, *params):
        ctx.bucket, ctx.state = bucket, state
        ctx.set_materialize_grads(False)  # a value the block did not use (its module moved it itself) gets None
        return tuple(
            bucket.finish(pending or bucket.issue(state.param_dtype, f"gather {bucket.name} to its compute layout"))
        )

    @staticmethod
    def backward(ctx, *grads):
        # the block's backward is done with its regathered parameters
        ctx.bucket.regathered = ctx.bucket.pending_regather = None
        return (None, None, None) + tuple(ctx.bucket.reduce(list(grads), ctx.state))


class _GatherBucketLocal(torch.autograd.Function):
    """`_GatherBucket` for a block on local tensors (spmd.runtime.local.blocks): the gathered local tensors, whose
    gradients backward lays out before reducing them (one node, not a DTensor and a `to_local` each)."""

    @staticmethod
    def forward(ctx, bucket: Bucket, state, pending, grad_layouts, *params):
        ctx.bucket, ctx.state, ctx.grad_layouts = bucket, state, grad_layouts
        ctx.set_materialize_grads(False)
        locals_ = bucket.finish_local(
            pending or bucket.issue(state.param_dtype, f"gather {bucket.name} to its compute layout")
        )
        return tuple(t.view_as(t) for t in locals_)

    @staticmethod
    def backward(ctx, *grads):
        bucket = ctx.bucket
        bucket.regathered = bucket.pending_regather = None
        grads = [
            None if g is None else wrap_local(g, bucket.mesh, layout, p.shape, g.stride())
            for g, p, layout in zip(grads, bucket.params, ctx.grad_layouts)
        ]
        return (None, None, None, None) + tuple(bucket.reduce(grads, ctx.state))


def gather_bucket(bucket: Bucket, state, grad_layouts=None) -> dict:
    """{id(param): gathered DTensor} for the bucket's parameters, differentiable (reductions in backward).
    Finishes the gather issued ahead for this bucket, if any, and issues the next block's. With
    `grad_layouts` (one per parameter) the values are local tensors whose gradients take those layouts."""
    pending = state.prefetched.pop(id(bucket), None)
    if grad_layouts is None:
        values = _GatherBucket.apply(bucket, state, pending, *bucket.params)
    else:
        values = _GatherBucketLocal.apply(bucket, state, pending, tuple(grad_layouts), *bucket.params)
    nxt = bucket.next
    if nxt is not None and id(nxt) not in state.prefetched and not gathers_in_graph(nxt.module):
        state.prefetched[id(nxt)] = nxt.issue(state.param_dtype, f"gather {nxt.name} to its compute layout, prefetched")
    return {id(p): v for p, v in zip(bucket.params, values)}


def regather_for_recompute(bucket: Bucket, state) -> dict:
    """{id(param): gathered DTensor} for a checkpointed block's recompute: the bucket at once, as in forward
    (one all-gather per mesh axis). Differentiable like forward's, so the recompute saves what forward saved."""
    pending = bucket.issue(state.param_dtype, f"regather {bucket.name} for recompute")
    return {id(p): v for p, v in zip(bucket.params, _GatherBucket.apply(bucket, state, pending, *bucket.params))}


def make_buckets(model, mesh, wire=None) -> tuple[dict, dict]:
    """({id(module): Bucket}, {id(param): Bucket}) for the model's repeated blocks and its root unit (the
    parameters outside the blocks). A bucket holds parameters that shard_dims covers and no two modules share;
    its gathers travel in `wire`'s precision."""
    try:
        path, blocks = find_blocks(model)
    except ValueError:
        return {}, {}  # no repeated blocks: every parameter moves on its own
    by_block, by_param, chain = {}, {}, []
    for key, block in blocks._modules.items():  # keys: the blocks' indices in the model (a pipeline stage's too)
        params = list(
            {
                id(p): p
                for p in block.parameters()
                if isinstance(p, DTensor) and not getattr(p, "_spmd_shared", False) and shard_dims(p, mesh) is not None
            }.values()
        )
        if len(params) > 1:
            b = Bucket(f"{path}.{key}" if path else key, block, params, mesh)
            by_block[id(block)] = b
            by_param.update({id(p): b for p in params})
            chain.append(b)
    for a, b in zip(chain, chain[1:]):  # blocks run in list order: each prefetches the next
        a.next, b.prev = b, a
    for b in chain:
        b.wire = wire
    rest = list(
        {
            id(p): p
            for p in model.parameters()
            if isinstance(p, DTensor)
            and id(p) not in by_param
            and not getattr(p, "_spmd_shared", False)
            and shard_dims(p, mesh) is not None
        }.values()
    )
    if rest:  # the root unit (FSDP2's): gathered once as the model starts, kept until backward
        root = Bucket(type(model).__name__, model, rest, mesh)
        root.keep, root.wire = True, wire
        root.next = chain[0] if chain else None
        by_block[id(model)] = root
        by_param.update({id(p): root for p in rest})
    return by_block, by_param


def drop_root_unit(state, model) -> None:
    """Leaves the parameters outside the blocks out of any bucket: each moves on its own, and is regathered
    in backward rather than kept from forward (a pipeline stage's micro-batches would each keep a copy)."""
    root = state.buckets.pop(id(model), None)
    if root is not None:
        for p in root.params:
            state.bucket_of.pop(id(p), None)
