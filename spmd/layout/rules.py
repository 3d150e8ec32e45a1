"""Rules: the table that maps logical axis names to mesh axes.

Two maps, as Levanter has them. The compute map lays out activations and the parameters in use; the params
map is the compute map plus storage-only entries (`embed -> fsdp`). FSDP is the difference between the two.
The grads and optimizer maps say the same of reduced gradients and of optimizer states (with the sharded
master weights the optimizer updates): a ZeRO stage is which of the three maps add `embed -> fsdp`.
The batch rule says which mesh axes split the data: every data-parallel size and rank comes from it.
"""

import difflib

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .mesh import MESH_AXES

__all__ = ["Rules", "placements_for", "local_shape", "ZERO_STAGES"]

MeshAxes = tuple[str, ...]
ZERO_STAGES = (0, 1, 2, 3)  # which states `embed -> fsdp` shards: 0 none, 1 optimizer, 2 + grads, 3 + params


def _as_axes(value, where: str) -> MeshAxes:
    if value is None:
        return ()
    axes = (value,) if isinstance(value, str) else tuple(value)
    for axis in axes:
        if axis not in MESH_AXES:
            hint = difflib.get_close_matches(str(axis), MESH_AXES, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"use one of {MESH_AXES}"
            raise ValueError(f"{where} names mesh axis {axis!r}, which is not a known axis; {fix}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{where} uses mesh axis {axes} more than once; name each mesh axis once")
    return axes


class Rules:
    """Logical axis -> mesh axis or axes, one map per state. `params` adds storage-only sharding on top of
    `compute`; `grads` (default: as params) and `optimizer` (default: as grads) each add to the one before."""

    def __init__(
        self, compute: dict, params: dict | None = None, grads: dict | None = None, optimizer: dict | None = None
    ):
        self.compute = {k: _as_axes(v, f"compute rule {k!r}") for k, v in compute.items()}
        self.params = self._adds(self.compute, params, "params")
        self.grads = self._adds(self.params, grads, "grads")
        self.optimizer = self._adds(self.grads, optimizer, "optimizer")

    @staticmethod
    def _adds(base: dict, extra: dict | None, which: str) -> dict:
        extra = {k: _as_axes(v, f"{which} rule {k!r}") for k, v in (extra or {}).items()}
        for k, axes in extra.items():
            if not set(base.get(k, ())) <= set(axes):
                raise ValueError(
                    f"{which} rule {k!r}: {axes} drops mesh axes {base[k]} of the map before it; each "
                    f"map (compute, params, grads, optimizer) may only add sharding to the one before"
                )
        return {**base, **extra}

    @classmethod
    def default(cls, sequence_parallel: bool = False, zero: int = 3) -> "Rules":
        """The Llama table. `zero` picks which states `embed -> fsdp` shards over the fsdp axis: 1 optimizer
        states, 2 also gradients, 3 also parameters (FSDP); 0 none (plain data parallel over fsdp too)."""
        if zero not in ZERO_STAGES:
            raise ValueError(
                f"ZeRO stage {zero!r} is not one of {ZERO_STAGES}: 1 shards optimizer states, 2 also "
                f"gradients, 3 also parameters (FSDP, the default); 0 shards none"
            )
        # Order matters for activations: when two dims of one activation claim the same mesh axis, the
        # earlier rule keeps it (logits under sequence parallelism keep vocab on tp and gather seq).
        # ep splits the batch as dp and fsdp do, and the experts (expert parallelism inside data parallelism)
        compute = {
            "batch": ("dp", "fsdp", "ep"),
            "vocab": "tp",
            "heads": "tp",
            "kv_heads": "tp",
            "mlp": "tp",
            "experts": "ep",
        }
        # The sequence splits over cp everywhere (attention runs as a ring there), and also over tp in the
        # sequence-parallel regions; cp of size 1 is inactive, so the rule costs nothing without it.
        compute["seq"] = ("cp", "tp") if sequence_parallel else "cp"
        shard = {"embed": "fsdp"}
        return cls(
            compute,
            params=shard if zero >= 3 else None,
            grads=shard if zero >= 2 else None,
            optimizer=shard if zero >= 1 else None,
        )

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage these maps make: how many of optimizer, grads, params shard beyond compute."""
        return sum(m != self.compute for m in (self.optimizer, self.grads, self.params))

    @property
    def sequence_parallel(self) -> bool:
        return "tp" in self.compute.get("seq", ())

    def __repr__(self):
        return f"Rules(compute={self.compute}, params={self.params}, grads={self.grads}, optimizer={self.optimizer})"

    def batch_axes(self) -> MeshAxes:
        """The mesh axes that split the batch (dp and fsdp by default): the data-parallel axes."""
        return self.compute.get("batch", ())

    def token_axes(self) -> MeshAxes:
        """The mesh axes that split the tokens (the batch's and the sequence's): those a weight's gradient and
        the loss are summed over."""
        return tuple(dict.fromkeys(a for logical in ("batch", "seq") for a in self.compute.get(logical, ())))

    def data_parallel_size(self, sizes) -> int:
        """How many ways the batch splits on a mesh (a DeviceMesh or {axis: size})."""
        sizes = _sizes(sizes)
        n = 1
        for axis in self.batch_axes():
            n *= sizes.get(axis, 1)
        return n

    def data_parallel_rank(self, mesh: DeviceMesh) -> int:
        """Which slice of the batch this rank holds on `mesh` (mixed radix over the batch axes, outer first)."""
        rank = 0
        for axis in self.batch_axes():
            if axis in mesh.mesh_dim_names:
                rank = rank * mesh.size(mesh.mesh_dim_names.index(axis)) + mesh.get_local_rank(axis)
        return rank

    def mesh_axes(self, logical_axes, which: str, name: str, strict: bool = True) -> list[MeshAxes]:
        """Mesh axes for each tensor dim. `strict` (parameters) rejects a mesh axis used by two dims;
        otherwise (activations) the dim whose rule comes first keeps it."""
        table = getattr(self, which)
        order = {k: i for i, k in enumerate(table)}
        result: list[MeshAxes] = [table.get(a, ()) if a is not None else () for a in logical_axes]
        owner: dict[str, int] = {}
        for dim in sorted(range(len(result)), key=lambda d: order.get(logical_axes[d], len(order))):
            kept = []
            for axis in result[dim]:
                if axis in owner:
                    if strict:
                        raise ValueError(
                            f"{name}: mesh axis {axis!r} would shard both dim {owner[axis]} "
                            f"({logical_axes[owner[axis]]!r}) and dim {dim} ({logical_axes[dim]!r}); "
                            f"a mesh axis can shard one dim of a tensor: change the annotation or the rules"
                        )
                    continue
                owner[axis] = dim
                kept.append(axis)
            result[dim] = tuple(kept)
        return result


def placements_for(mesh: DeviceMesh, dims_axes: list[MeshAxes], shape, name: str) -> list[Placement]:
    """Per-mesh-dim placements for a tensor whose dim d is sharded over `dims_axes[d]`.
    Axes absent from the mesh or of size 1 are inactive. Checks divisibility."""
    names = mesh.mesh_dim_names
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}  # (not mesh.shape: torch 2.11's compiler cannot zip it)
    placements: list[Placement] = [Replicate() for _ in names]
    seen: dict[str, int] = {}
    for dim, axes in enumerate(dims_axes):
        for axis in axes:
            if axis in seen:
                raise ValueError(
                    f"{name}: mesh axis {axis!r} is used for dims {seen[axis]} and {dim}; "
                    f"a mesh axis can shard one dim of a tensor"
                )
            seen[axis] = dim
    for dim, axes in enumerate(dims_axes):
        factor = 1
        for axis in axes:
            size = int(sizes.get(axis, 1))
            if size == 1:
                continue
            factor *= size
            placements[names.index(axis)] = Shard(dim)
        if shape is not None and factor > 1 and shape[dim] % factor:
            raise ValueError(
                f"{name} with shape {tuple(shape)}: dim {dim} of size {shape[dim]} does not divide by "
                f"{'x'.join(a for a in axes if sizes.get(a, 1) > 1)}={factor}; pick a mesh whose "
                f"{'/'.join(axes)} size divides {shape[dim]}, or change the rule for this axis"
            )
    return placements


def _sizes(mesh_or_sizes) -> dict:
    if isinstance(mesh_or_sizes, DeviceMesh):
        return dict(zip(mesh_or_sizes.mesh_dim_names, mesh_or_sizes.shape))
    return dict(mesh_or_sizes)


def local_shape(global_shape, axes, mesh: DeviceMesh, rules: Rules, name: str = "pipeline stage input") -> tuple:
    """This rank's shape of an activation with these logical axes under the rules' compute map."""
    dims = rules.mesh_axes(axes, "compute", name, strict=False)
    placements = placements_for(mesh, dims, global_shape, name)
    shape, _ = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(shape)
