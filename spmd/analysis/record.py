"""Recording every collective a step issues: what, where, over which mesh axes, how many bytes, which phase.

A dispatch mode sees each collective on local tensors after DTensor has lowered it. The code that issues
it says why through `spmd.runtime.tags.reason(...)`: the pass's planned redistributions carry their reason; a collective
that DTensor inserts on its own inside an op is tagged `implicit` (a layout the pass failed to plan).

Bytes are per rank on the wire for ring algorithms, the convention of the reference formulas:
all_gather and reduce_scatter move S*(n-1)/n for a full tensor of S bytes; all_reduce moves 2*S*(n-1)/n;
a send or recv moves its tensor; an all_to_all with split sizes moves the rows this rank sends to the
others (S*(n-1)/n of its input when the splits are even), whichever API issued it.
Steps are the same algorithms' rounds, each one message latency on the critical path: n-1 for all_gather,
reduce_scatter, all_to_all and broadcast, 2(n-1) for all_reduce (a reduce-scatter then an all-gather), 1 for a
send or recv.
"""

import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..layout.mesh import group_axes
from ..runtime.tags import current_module, current_phase, current_reason, reason

__all__ = ["Collective", "CollectiveRecorder", "wire_bytes", "ring_steps"]

_funcol = torch.ops._c10d_functional
_c10d = torch.ops.c10d

# op packet -> (kind, index of the group-name argument)
_FUNCOL = {
    _funcol.all_gather_into_tensor: ("all_gather", 2),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", 3),
    _funcol.all_reduce: ("all_reduce", 2),
    _funcol.all_to_all_single: ("all_to_all", 3),
    _funcol.broadcast: ("broadcast", 2),
}
_C10D = {
    _c10d.allreduce_: "all_reduce",
    _c10d._allgather_base_: "all_gather",
    _c10d.allgather_: "all_gather",
    _c10d._reduce_scatter_base_: "reduce_scatter",
    _c10d.reduce_scatter_: "reduce_scatter",
    _c10d.alltoall_base_: "all_to_all",
    _c10d.broadcast_: "broadcast",
    _c10d.send: "send",
    _c10d.recv_: "recv",
}


@dataclass
class Collective:
    module: str
    op: str  # what issued it: the planned move, or the torch op
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast | send | recv
    axes: tuple  # mesh axes of the process group
    bytes: int  # per rank, on the wire (see module docstring)
    phase: str  # forward | backward | optimizer
    reason: str = ""
    origin: str = "planned"  # planned | op | implicit
    dtype: str = ""
    shape: tuple = ()
    per_rank: tuple = ()  # bytes of each rank (by global rank) where ranks differ (spmd.Muon's); `bytes` the most

    def bytes_of(self, rank: int | None) -> int:
        """This collective's bytes on `rank` (None: `bytes`)."""
        return self.per_rank[rank] if rank is not None and self.per_rank else self.bytes

    def to_dict(self):
        return asdict(self)


def _process_group(arg):
    """c10d ops take their group boxed as a ScriptObject."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except (RuntimeError, AttributeError):
            return None
    return None


def wire_bytes(kind: str, full_bytes: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * full_bytes * (n - 1) // n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return full_bytes * (n - 1) // n
    return full_bytes


def ring_steps(kind: str, n: int) -> int:
    """Message rounds of a ring `kind` over n ranks (module docstring): what its latency term counts."""
    if n <= 1:
        return 0
    if kind in ("send", "recv"):
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


class CollectiveRecorder(TorchDispatchMode):
    """Records collectives into `self.records`. `group_axes` maps process-group names to mesh axes."""

    def __init__(self, mesh=None):
        super().__init__()
        self.records: list[Collective] = []
        self.mesh = mesh
        self.group_axes: dict[str, tuple] = group_axes(mesh) if mesh is not None else {}

    def _axes(self, group_name) -> tuple:
        if group_name not in self.group_axes:
            mesh_groups = group_axes(self.mesh) if self.mesh is not None else {}
            self.group_axes.update(mesh_groups)  # a group flattened since (spmd.layout.mesh)
            if group_name not in self.group_axes:
                self.group_axes[group_name] = _same_ranks(group_name, mesh_groups) or (str(group_name),)
        return self.group_axes[group_name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        packet = getattr(func, "_overloadpacket", None)
        out = self._issue(func, args, kwargs) if packet in _FUNCOL or packet in _C10D else func(*args, **kwargs)
        if packet in _FUNCOL:
            kind, gi = _FUNCOL[packet]
            group_name = args[gi] if len(args) > gi else kwargs.get("group_name")
            n = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
            t = args[0]
            full = t.numel() * t.element_size() * (n if kind == "all_gather" else 1)
            nbytes = wire_bytes(kind, full, n)
            if kind == "all_to_all" and args[2]:  # variable splits: what this rank sends to the others
                group = dist.distributed_c10d._resolve_process_group(group_name)
                row = t[0].numel() * t.element_size() if t.shape[0] else 0
                nbytes = (sum(args[2]) - args[2][dist.get_rank(group)]) * row
            self._add(kind, self._axes(group_name), nbytes, str(func), t)
        elif packet in _C10D:
            kind = _C10D[packet]
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            t = tensors[0] if not isinstance(tensors[0], (list, tuple)) else tensors[0][0]
            pg = next((_process_group(a) for a in args if _process_group(a) is not None), None)
            n = pg.size() if pg is not None else 1
            full = t.numel() * t.element_size()
            nbytes = full if kind in ("send", "recv") else wire_bytes(kind, full, n)
            if kind == "all_to_all" and args[4]:  # (output, input, group, out splits, in splits): as funcol's
                t, row = args[1], args[1][0].numel() * args[1].element_size() if args[1].shape[0] else 0
                nbytes = (sum(args[4]) - args[4][pg.rank()]) * row
            self._add(kind, self._axes(pg.group_name) if pg is not None else (), nbytes, str(func), t)
        return out

    def _issue(self, func, args, kwargs):
        """Runs a collective op (spmd.analysis.timed times it here)."""
        return func(*args, **kwargs)

    def _add(self, kind, axes, nbytes, op, t):
        ctx = current_reason()
        backward = torch._C._current_autograd_node() is not None
        ph = "backward" if backward and current_phase() == "forward" else current_phase()
        if ctx is None:
            module, why, origin = current_module(), f"issued by {_caller()}", "op"
        else:
            module, why, origin = ctx
        self.records.append(
            Collective(
                module=module,
                op=op,
                kind=kind,
                axes=tuple(axes),
                bytes=int(nbytes),
                phase=ph,
                reason=why,
                origin=origin,
                dtype=str(t.dtype).replace("torch.", ""),
                shape=tuple(t.shape),
            )
        )


def _same_ranks(group_name, mesh_groups: dict) -> tuple | None:
    """The axes of the mesh group with the same ranks as `group_name`: DTensor caches its plans by mesh layout,
    so an op on an equal mesh built earlier in the process runs on that mesh's groups."""
    ranks_of = lambda name: dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))  # noqa: E731
    ranks = ranks_of(group_name)
    return next((axes for name, axes in mesh_groups.items() if ranks_of(name) == ranks), None)


def _caller() -> str:
    """The innermost function outside torch that issued a collective, e.g. `kernels.vocab_parallel.forward`."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        # the GlobalView mode sits between every model op and torch: it passes ops on, it issues nothing
        if not (module.startswith("torch") or module in (__name__, "spmd.runtime.activations.global_view")):
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


def _patch_implicit_redistribution():
    """Tags the redistributions DTensor performs inside an op's dispatch, so a plan can show them."""
    from torch.distributed.tensor import _dispatch

    original = getattr(_dispatch, "redistribute_local_tensor", None)
    if original is None or getattr(original, "_spmd_tagged", False):
        return

    def tagged(local_tensor, current_spec, target_spec, *args, **kwargs):
        module = current_module()
        with reason(
            module, f"DTensor op redistributed {current_spec.placements} -> {target_spec.placements}", origin="implicit"
        ):
            return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    tagged._spmd_tagged = True
    _dispatch.redistribute_local_tensor = tagged


_patch_implicit_redistribution()
