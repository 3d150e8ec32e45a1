"""Gradient reductions that span blocks, in buckets of a set size (DDP's, 25 MB by default).

A flat group's backward hands over each gradient needing at most one reduce-scatter then one all-reduce. They fill
buffers per reduction and dtype, each issued asynchronously when full (the first at 1 MB, as DDP's, so the last
block's gradients travel during backward); the rest are issued, waited on and set at the end of backward.
Under `offload="optimizer"` a finished buffer goes to the copy-out (optimizer.transfer).
"""

from torch.distributed.tensor import DTensor

from .. import collectives, tags
from ..dtensor.stack import after_backward
from ..dtensor.wrap import cast, local_of, wrap_local
from .layouts import grads_layout, reduce_gradient

__all__ = ["GradientReducer", "DEFAULT_BUCKET_MB", "FIRST_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0  # torch DistributedDataParallel's bucket_cap_mb
FIRST_BUCKET_MB = 1.0  # DistributedDataParallel's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


class _Issued:
    """A buffer in flight: `pending` reduce-scatters over `scatter` (when set), then all-reduces over `summed`;
    `members` (param, (placements, shape, stride) of its gradient once reduced, block)."""

    def __init__(self, key, members, pending, block: str, what: str):
        (self.scatter, self.summed, _), self.members, self.pending = key, members, pending
        self.block, self.what = block, what
        self.summing = self.scatter is None  # whether `pending` is the last collective
        self.copied = False  # whether its results were handed to the copy-out

    def advance(self, mesh, wire=None):
        """Waits for the reduce-scatter and issues the all-reduce of its shards (no-op when that is done)."""
        if self.summing:
            return
        self.summing = True
        if self.summed:
            with tags.phase("backward"), tags.reason(self.block, f"all-reduce {self.what}, shards"):
                self.pending = collectives.all_reduce(self.pending.results(), mesh, self.summed, wire)


class GradientReducer:
    def __init__(self, mesh, bucket_mb: float = DEFAULT_BUCKET_MB, wire=None):
        self.mesh, self.cap, self.wire = mesh, int(bucket_mb * 2**20), wire  # wire: spmd.runtime.wire.Wire
        self.first_cap = min(self.cap, int(FIRST_BUCKET_MB * 2**20))
        self.started: set = set()  # keys with a buffer issued in this backward (the later ones take `cap`)
        self.open: dict = {}  # (scatter dim | None, summed dims, dtype) -> [(param, unreduced gradient, block)]
        self.sizes: dict = {}  # same key -> bytes in the open buffer
        self.issued: list = []  # _Issued, in order
        self.queued = False
        self.copies = None  # offload="optimizer": spmd.runtime.optimizer.transfer.GradientCopies, fed as buffers land

    def reset(self):
        """Forgets buffers a backward that failed part-way left (called as each forward starts)."""
        self.open, self.sizes, self.issued, self.queued, self.started = {}, {}, [], False, set()

    def add(self, p, g: DTensor, scatter: int | None, summed: tuple, block: str):
        """Takes `g` for `p`, partial over mesh dim `scatter` (reduce-scattered) and `summed` (all-reduced) only."""
        key = (scatter, tuple(summed), g.dtype)
        self.open.setdefault(key, []).append((p, g, block))
        self.sizes[key] = self.sizes.get(key, 0) + local_of(g).numel() * local_of(g).element_size()
        if not self.queued:
            after_backward(self.finish)
            self.queued = True
        if self.sizes[key] >= (self.cap if key in self.started else self.first_cap):
            self._issue(key)

    def _issue(self, key):
        scatter, summed, _ = key
        members = self.open.pop(key)
        self.sizes.pop(key)
        self.started.add(key)
        blocks = sorted({b for _, _, b in members})
        what = f"gradients of {', '.join(blocks)} ({len(members)} parameters, one buffer)"
        tensors = [local_of(g) for _, g, _ in members]
        for earlier in self.issued:
            earlier.advance(self.mesh, self.wire)
        kind = "all-reduce" if scatter is None else "reduce-scatter"
        with tags.phase("backward"), tags.reason(blocks[0], f"{kind} {what}"):
            if scatter is None:
                pending = collectives.all_reduce(tensors, self.mesh, summed, self.wire)
            else:
                dims = [grads_layout(p)[scatter].dim for p, _, _ in members]
                pending = collectives.reduce_scatter(tensors, dims, self.mesh, scatter, self.wire)
        self._copy_out(self.issued)  # those issued before: they have had this buffer's backward to travel
        # only the reduced layouts are kept: each unreduced gradient is freed now, not held to the end of backward
        done = {scatter, *summed}
        members = [
            (p, ([grads_layout(p)[m] if m in done else x for m, x in enumerate(g.placements)], g.shape, g.stride()), b)
            for p, g, b in members
        ]
        self.issued.append(_Issued(key, members, pending, blocks[0], what))

    def _copy_out(self, buffers):
        """Hands the buffers whose last collective is issued to the offloaded step's copy-out (once each)."""
        if self.copies is None:
            return
        for buffer in buffers:
            if buffer.summing and not buffer.copied:
                buffer.copied = True
                self.copies.copy_pending([p for p, _, _ in buffer.members], buffer.pending)

    def finish(self):
        """End of backward: issues the open buffers, waits for all, and sets the parameters' gradients."""
        for key in list(self.open):
            self._issue(key)
        issued, self.issued, self.queued, self.started = self.issued, [], False, set()
        for buffer in issued:
            buffer.advance(self.mesh, self.wire)
        if self.copies is not None:
            self._copy_out(issued)
            self.copies.side.join()  # the copy-out waited for those collectives on its stream
        for buffer in issued:
            for (p, (placements, shape, stride), _), reduced in zip(buffer.members, buffer.pending.results()):
                value = wrap_local(reduced, self.mesh, placements, shape, stride)
                value = cast(reduce_gradient(value, grads_layout(p), False, False), p.dtype)
                p.grad = value if p.grad is None else p.grad + value
                if self.copies is not None:
                    self.copies.ready(p)
