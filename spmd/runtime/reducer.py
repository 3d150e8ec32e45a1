"""Gradient reductions that span blocks, in buckets of a set size (DDP's, 25 MB by default).

A bucket's backward (spmd.runtime.buckets) hands over each gradient that one collective over one mesh axis
brings to its grads layout (DP's all-reduce, FSDP's reduce-scatter). They join the open buffer of their
kind, mesh axis and dtype; a buffer that reaches the size is issued at once, asynchronously, while backward
goes on. At the end of backward the rest are issued, everything is waited on, and each parameter's gradient
is set (added to the one it already holds). So a model whose gradients fit one buffer reduces them in one
collective per kind, as DDP does, instead of one per block.
"""
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from . import tags
from .gradients import grads_layout, reduce_to

__all__ = ["GradientReducer", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0  # torch DistributedDataParallel's bucket_cap_mb


def _wait(t):
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class GradientReducer:
    def __init__(self, mesh, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.mesh, self.cap = mesh, int(bucket_mb * 2**20)
        self.open: dict = {}     # (kind, mesh dim, dtype) -> [(param, unreduced DTensor gradient, block name)]
        self.sizes: dict = {}    # same key -> bytes in the open buffer
        self.issued: list = []   # (kind, mesh dim, members, shapes, async result)
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
        n = self.mesh.size(m)
        blocks = sorted({b for _, _, b in members})
        what = f"gradients of {', '.join(blocks)} ({len(members)} parameters, one buffer)"
        with tags.phase("backward"):
            if kind == "reduce_scatter":
                chunks = [g._local_tensor.chunk(n, dim=grads_layout(p)[m].dim) for p, g, _ in members]
                flat = torch.cat([c[r].reshape(-1) for r in range(n) for c in chunks])
                shapes = [c[0].shape for c in chunks]
                with tags.reason(blocks[0], f"reduce-scatter {what}"):
                    out = funcol.reduce_scatter_single(flat, "sum", 0, (self.mesh, m))
            else:
                flat = torch.cat([g._local_tensor.reshape(-1) for _, g, _ in members])
                shapes = [g._local_tensor.shape for _, g, _ in members]
                with tags.reason(blocks[0], f"all-reduce {what}"):
                    out = funcol.all_reduce(flat, "sum", (self.mesh, m))
        self.issued.append((m, members, shapes, out))

    def finish(self):
        """End of backward: issues the open buffers, waits for all, and sets the parameters' gradients."""
        for key in list(self.open):
            self._issue(key)
        issued, self.issued, self.queued = self.issued, [], False
        for m, members, shapes, out in issued:
            reduced, offset = _wait(out), 0
            for (p, g, _), shape in zip(members, shapes):
                k = shape.numel()
                placements = list(g.placements)
                placements[m] = grads_layout(p)[m]
                value = DTensor.from_local(reduced[offset:offset + k].view(shape), self.mesh, tuple(placements),
                                           run_check=False, shape=g.shape, stride=g.stride())
                offset += k
                if tuple(value.placements) != grads_layout(p):
                    value = reduce_to(value, grads_layout(p))
                if value.dtype != p.dtype:
                    value = value.to(p.dtype)
                p.grad = value if p.grad is None else p.grad + value
