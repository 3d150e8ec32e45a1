"""Named device meshes: `make_mesh({"fsdp": 4, "tp": 2})` and the spec strings users type (`fsdp=4,tp=2,sp`).

Mesh dims are laid out in a fixed order, pipeline outermost and tensor parallel innermost, so the ranks of
a tensor-parallel group are neighbours (one node, fastest links) whatever order the user wrote; context
parallel (`cp`, the sequence across ranks) sits just outside tp, its ring the next-fastest links.
"""

import atexit
import itertools
import logging
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "MESH_AXES",
    "SPEC_FLAGS",
    "parse_spec",
    "check_sizes",
    "format_sizes",
    "init_distributed",
    "exit_process",
    "release_groups",
    "make_mesh",
    "mesh_sizes",
    "flatten_groups",
    "group_over",
    "group_axes",
]

MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")  # outermost first (Megatron's order: tp innermost, then cp, ep)
SPEC_FLAGS = ("sp",)


def parse_spec(spec: str) -> tuple[dict[str, int], set[str]]:
    """`"fsdp=2,tp=2,sp"` -> ({"fsdp": 2, "tp": 2}, {"sp"}). Raises ValueError on anything malformed."""
    sizes: dict[str, int] = {}
    flags: set[str] = set()
    for part in (p.strip() for p in spec.replace("+", ",").split(",")):
        if not part:
            continue
        if "=" not in part:
            if part not in SPEC_FLAGS:
                raise ValueError(
                    f"unknown flag {part!r} in spec {spec!r}; flags are {SPEC_FLAGS}, axes are written axis=size"
                )
            flags.add(part)
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} appears twice in spec {spec!r}; give each axis once")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis size must be an integer, got {part!r} in spec {spec!r}") from None
    check_sizes(sizes)
    return sizes, flags


def check_sizes(sizes) -> None:
    if not isinstance(sizes, dict):
        raise TypeError(f"mesh sizes must be a dict like {{'fsdp': 4, 'tp': 2}}, got {type(sizes).__name__}")
    for name, size in sizes.items():
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r}; allowed axes are {MESH_AXES}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive integer size, got {size!r}")


def _world_from_env() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def init_distributed(device_type: str) -> None:
    """Starts the default process group from torchrun's environment, or a one-process group when alone."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def exit_process(code: int = 0):
    """Ends a distributed worker with `code`: destroys the process groups, flushes output and exits without
    interpreter finalization. With torch 2.13's gloo backend, finalization can abort a process that has
    finished its work ("terminate called without an active exception": a script that only starts a gloo
    group, all-reduces once and destroys it does so in about half of its runs on CPU), which torchrun
    would report as a failed run."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_mesh(sizes, device_type: str | None = None) -> DeviceMesh:
    """A DeviceMesh whose dims carry the given axis names; their product must equal the world size."""
    if isinstance(sizes, str):
        sizes, _ = parse_spec(sizes)
    check_sizes(sizes)
    if not sizes:
        raise ValueError("a mesh needs at least one axis, e.g. {'dp': 1}")
    product = 1
    for size in sizes.values():
        product *= size
    world = dist.get_world_size() if dist.is_initialized() else (_world_from_env() or 1)
    if product != world:
        raise ValueError(
            f"mesh {format_sizes(sizes)} has {product} devices but the world size is {world}; "
            f"make the product of the axis sizes equal the number of processes"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    init_distributed(device_type)
    names = tuple(a for a in MESH_AXES if a in sizes)
    mesh = init_device_mesh(device_type, tuple(sizes[a] for a in names), mesh_dim_names=names)
    if not _MESHES:
        atexit.register(release_groups)
    _MESHES.append(weakref.ref(mesh))
    return mesh


_MESHES: list = []  # weak references to the meshes made here, whose process groups release_groups lets go


def release_groups() -> None:
    """Ends the process groups while the interpreter is whole (at exit, from an atexit handler): destroys them
    if the script did not (unless it is ending on an uncaught exception: a peer may be stuck in a collective),
    then drops the meshes' own references to them. A DeviceMesh keeps its groups in `_pg_registry`, so after
    `destroy_process_group()` every gloo group of a mesh still lives, its worker threads too. Left to the
    interpreter's finalization, a worker that still holds a finished collective frees its tensors there, must
    take the GIL to do so, is made to exit by the finalizing interpreter inside native code, and aborts the
    process ("terminate called without an active exception"). Dropped here, each group's destructor joins its
    workers (it releases the GIL for them) before finalization starts."""
    if dist.is_initialized():
        if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
            return
        dist.destroy_process_group()
    for ref in _MESHES:
        mesh = ref()
        if mesh is not None:
            for m in (mesh, *mesh._flatten_mapping.values()):
                m._pg_registry.clear()


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """Every known axis with its size; axes absent from the mesh count as size 1."""
    present = dict(zip(mesh.mesh_dim_names, mesh.shape))
    return {a: int(present.get(a, 1)) for a in MESH_AXES}


def format_sizes(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def flatten_groups(mesh: DeviceMesh, axes) -> None:
    """Makes the flattened process group of every set of two or more of `axes` that `mesh` has with size > 1,
    so a sum over several axes (a gradient replicated over dp and tp, the loss over dp and fsdp) runs as one
    collective (`group_over`). Making a group involves every rank of the world: it happens here, where all
    ranks run the same code, and never during a step (pipeline stages reach their reductions at different
    times)."""
    names = [a for a in mesh.mesh_dim_names if a in axes and mesh.size(mesh.mesh_dim_names.index(a)) > 1]
    with unset_fake_temporarily():  # the mesh's own index tensors are real, also in a dry run
        for k in range(2, len(names) + 1):
            for combo in itertools.combinations(names, k):
                mesh[combo]._flatten()


def group_over(mesh: DeviceMesh, dims):
    """The process group of mesh dims `dims` together: one dim's group; for several, the group of the 1-D mesh
    that flattens them, or None where `flatten_groups` made none (the caller then sums axis by axis)."""
    dims = sorted(dims)
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    flat = mesh._get_root_mesh()._flatten_mapping.get("_".join(mesh.mesh_dim_names[d] for d in dims))
    return None if flat is None else flat.get_group()


def group_axes(mesh: DeviceMesh) -> dict[str, tuple]:
    """{process-group name: the mesh axes it spans} for each axis of `mesh` and each flattened group of them."""
    out = {mesh.get_group(name).group_name: (name,) for name in mesh.mesh_dim_names}
    for name, flat in mesh._get_root_mesh()._flatten_mapping.items():
        out[flat.get_group().group_name] = tuple(name.split("_"))  # torch joins the axis names with "_"
    return out
