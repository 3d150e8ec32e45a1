"""The copies of an offloaded optimizer step (`offload="optimizer"`), overlapped as DeepSpeed's ZeRO-Offload does:
gradients out to host buffers as backward reduces them (on CUDA on a side stream), copied again at the step if
changed since (checked by identity, version and bit sum); updated masters in one gather buffer at a time, each
buffer's all-gather waiting for its own copies only. On a CPU-only machine the copies run at once, in order.
"""

import contextlib
import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from ..dtensor.wrap import local_of, wrap_local
from ..gradients.layouts import held_for_step

__all__ = ["SideStream", "side_stream", "GradientCopies", "bit_sum"]

COPY_HOOK_ATTR = "_spmd_copy_out_hook"  # on a parameter: the handle of its gradient copy-out hook


class SideStream:
    """Copies between host and device memory on a side stream (CUDA), or at once (any other device)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def on_side(self):
        """A context queueing work on the side stream (a collective's wait too: then the side stream waits for it)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after_current: bool = True):
        """`dst.copy_(src)`, after the current stream's work unless `after_current` is False; its CUDA event or None."""
        if self.stream is None:
            dst.copy_(src)
            return None
        if after_current:
            self.stream_wait_current()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for t in (dst, src):  # device memory the side stream reads or writes is not reused before it is done
            if t.is_cuda:
                t.record_stream(self.stream)
        return event

    def stream_wait_current(self) -> None:
        """Orders what is queued next on the side stream after the work queued so far on the current stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def host_wait(self) -> None:
        """Blocks the host until every copy issued so far is done (before the host reads what they wrote)."""
        if self.stream is not None:
            self.stream.synchronize()

    def join(self) -> None:
        """Makes the current stream wait for everything queued on the side stream, without blocking the host."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    @staticmethod
    def device_wait(event) -> None:
        """Makes the current stream wait for `event` (a copy `copy` issued) without blocking the host."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


@functools.cache
def side_stream(device: torch.device) -> SideStream:
    return SideStream(device)


class _Copy:
    """One gradient copied out: the device tensor (held, so its memory is not reused while the record lives),
    the bit sum of its values then, and the DTensor that became the parameter's gradient with its version."""

    def __init__(self, local: torch.Tensor, checksum: torch.Tensor):
        self.local, self.checksum = local, checksum
        self.grad, self.version = None, None

    def same_memory(self, t: torch.Tensor) -> bool:
        return (
            t.data_ptr() == self.local.data_ptr()
            and t.shape == self.local.shape
            and t.stride() == self.local.stride()
            and t.dtype == self.local.dtype
        )


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t`'s elements read as integers of their width: a change of any element changes it (up to
    changes that cancel exactly; a rescale never does: it moves every nonzero element's bits one way)."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int).sum(dtype=torch.int64)


class GradientCopies:
    """Backward's copies of reduced gradients into host buffers (masters taking the whole gradient, not ZeRO-1's). A
    copy is used only if the gradient is the same DTensor, version and bit sum: in-place ops on DTensors do not
    always move a version counter (clip_grad_norm_ moves none)."""

    def __init__(self, pairs, device: torch.device):
        self.side = side_stream(device)
        self.master_of = {id(p): m for p, m in pairs if not held_for_step(p)}
        self.buffers: dict = {}  # id(master) -> host tensor its gradient is copied into
        self.copied: dict = {}  # id(param) -> _Copy
        for p, _ in pairs:
            old = getattr(p, COPY_HOOK_ATTR, None)
            if old is not None:  # an earlier optimizer's hook: its copies would be read by nobody
                old.remove()
            if id(p) in self.master_of:
                setattr(p, COPY_HOOK_ATTR, p.register_post_accumulate_grad_hook(self.ready))

    def ready(self, p) -> None:
        """Copies `p`'s gradient out when it is reduced to its master's layout (not a no_sync pass's partial
        sum), unless `copy_pending` copied that very tensor: called as backward sets the gradient."""
        master, g = self.master_of.get(id(p)), p.grad
        if master is None or g is None or tuple(g.placements) != tuple(master.placements) or is_fake(g):
            return  # (a fake gradient: explain's dry run, nothing to copy)
        local = local_of(g)
        record = self.copied.get(id(p))
        if record is None or record.grad is not None or not record.same_memory(local):
            self.side.stream_wait_current()
            record = self.copied[id(p)] = self._copy(master, local)
        record.grad, record.version = g, g._version

    def copy_pending(self, params: list, pending) -> None:
        """Copies out the pieces of an issued flat reduction that become these parameters' gradients as soon as it
        lands (on CUDA the side stream waits for it); the reducer's `finish` then sets those same pieces."""
        chosen = [(i, p) for i, p in enumerate(params) if id(p) in self.master_of and p.grad is None]
        if not chosen or is_fake(self.master_of[id(chosen[0][1])]):
            return
        with self.side.on_side():
            pieces = pending.results()
        for i, p in chosen:
            master = self.master_of[id(p)]
            if pieces[i].shape == local_of(master).shape:
                self.copied[id(p)] = self._copy(master, pieces[i])

    def take(self, pairs) -> dict:
        """{id(param): master gradient from backward's copy} for `pairs` whose gradient is unchanged since; used up."""
        self.side.host_wait()  # every copy issued so far done: the step reads their buffers
        records = [(p, m, self.copied.pop(id(p), None)) for p, m in pairs]
        valid = [
            (p, m, r)
            for p, m, r in records
            if r is not None and p.grad is r.grad and p.grad._version == r.version and r.same_memory(local_of(p.grad))
        ]
        if not valid:
            return {}
        now = torch.stack([bit_sum(local_of(p.grad)) for p, _, _ in valid])
        then = torch.stack([r.checksum.to(now.device) for _, _, r in valid])
        same = (now == then).tolist()
        return {
            id(p): wrap_local(self.buffers[id(m)], m.device_mesh, m.placements, m.shape, m.stride())
            for (p, m, _), ok in zip(valid, same)
            if ok
        }

    def copy_now(self, g_local: torch.Tensor, master):
        """`master`'s gradient copied from `g_local` (its shard of the gradient) at the step, into its buffer."""
        buffer = self._buffer(master)
        buffer.copy_(g_local)
        return wrap_local(buffer, master.device_mesh, master.placements, master.shape, master.stride())

    def _copy(self, master, local: torch.Tensor) -> _Copy:
        """Queues `local`'s copy into `master`'s buffer and its bit sum on the side stream."""
        with self.side.on_side():
            checksum = bit_sum(local)
        self.side.copy(self._buffer(master), local, after_current=False)
        return _Copy(local, checksum)

    def _buffer(self, master) -> torch.Tensor:
        buffer = self.buffers.get(id(master))
        if buffer is None:
            local = local_of(master)
            buffer = self.buffers[id(master)] = torch.empty(
                local.shape, dtype=local.dtype, pin_memory=torch.cuda.is_available()
            )
        return buffer
