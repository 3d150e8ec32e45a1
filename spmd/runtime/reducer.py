"""Gradient reductions that span blocks, in buckets of a set size (DDP's, 25 MB by default).

A bucket's backward (spmd.runtime.buckets) hands over each gradient that one collective over one mesh axis
brings to its grads layout (DP's all-reduce, FSDP's reduce-scatter). They join the open buffer of their
kind, mesh axis and dtype; a buffer that reaches the size is issued at once, asynchronously, while backward
goes on. At the end of backward the rest are issued, everything is waited on, and each parameter's gradient
is set (added to the one it already holds). So a model whose gradients fit one buffer reduces them in one
collective per kind, as DDP does, instead of one per block.
"""
import torch
from torch.distributed.tensor import DTensor

from . import flat, tags
from .gradients import grads_layout, reduce_to

__all__ = ["GradientReducer", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0  # torch DistributedDataParallel's bucket_cap_mb


class GradientReducer:
    def __init__(self, mesh, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.mesh, self.cap = mesh, int(bucket_mb * 2**20)
        self.open: dict = {}     # (kind, mesh dim, dtype) -> [(param, unreduced DTensor gradient, block name)]
        self.sizes: dict = {}    # same key -> bytes in the open buffer
        self.issued: list = []   # (mesh dim, members, flat.Flat in flight)
        self.queued = False

    def reset(self):
        """Forgets buffers a backward that failed part-way left (called as each forward starts)."""
        self.open, self.sizes, self.issued, self.queued = {}, {}, [], False

    def add(self, p, g: DTensor, kind: str, m: int, block: str):
        """Takes `g` (a partial sum over mesh dim `m` only) for `p`; it is reduced by the end of backward."""
        key = (kind, m, g.dtype)
        self.open.setdefault(key, []).append((p, g, block))
        self.sizes[key] = self.sizes.get(key, 0) + g._local_tensor.numel() * g._local_tensor.element_size()
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.queued = True
        if self.sizes[key] >= self.cap:
            self._issue(key)

    def _issue(self, key):
        kind, m, _ = key
        members = self.open.pop(key)
        self.sizes.pop(key)
        blocks = sorted({b for _, _, b in members})
        what = f"gradients of {', '.join(blocks)} ({len(members)} parameters, one buffer)"
        tensors = [g._local_tensor for _, g, _ in members]
        with tags.phase("backward"):
            if kind == "reduce_scatter":
                with tags.reason(blocks[0], f"reduce-scatter {what}"):
                    pending = flat.reduce_scatter(tensors, [grads_layout(p)[m].dim for p, _, _ in members],
                                                  self.mesh, m)
            else:
                with tags.reason(blocks[0], f"all-reduce {what}"):
                    pending = flat.all_reduce(tensors, self.mesh, m)
        self.issued.append((m, members, pending))

    def finish(self):
        """End of backward: issues the open buffers, waits for all, and sets the parameters' gradients."""
        for key in list(self.open):
            self._issue(key)
        issued, self.issued, self.queued = self.issued, [], False
        for m, members, pending in issued:
            for (p, g, _), reduced in zip(members, pending.results()):
                placements = list(g.placements)
                placements[m] = grads_layout(p)[m]
                value = DTensor.from_local(reduced, self.mesh, tuple(placements), run_check=False, shape=g.shape,
                                           stride=g.stride())
                if tuple(value.placements) != grads_layout(p):
                    value = reduce_to(value, grads_layout(p))
                if value.dtype != p.dtype:
                    value = value.to(p.dtype)
                p.grad = value if p.grad is None else p.grad + value
