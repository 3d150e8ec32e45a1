"""Each rank's pipeline stages laid out (spmd.pipeline.build): the mesh a stage runs on (without pp), each stage
module parallelized with what a pipeline changes, its activation checkpointing, the check that no parameter is
shared across stages, and the release of the parameters of stages other ranks run."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..runtime.parallelize import parallelize
from ..runtime.parameters.buckets import drop_root_unit
from ..runtime.state import STATE_ATTR
from ..runtime.transforms.checkpointing import checkpoint_block
from .runtime import SPLIT_BACKWARD

__all__ = ["without_pp", "lay_out_stage", "checkpoint_stage", "check_no_shared_params", "release_others"]


def without_pp(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """(mesh with a pp dim and at least one other, the submesh without pp)."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "pp")
    if not names:  # a pp-only mesh: spmd.parallelize needs a mesh to lay the stage out on
        mesh = init_device_mesh(mesh.device_type, (mesh.size(), 1), mesh_dim_names=("pp", "dp"))
        names = ("dp",)
    return mesh, mesh[names]


def lay_out_stage(
    stage: nn.Module,
    info,
    stage_mesh,
    rules,
    schedule: str,
    every: int,
    blocks: nn.ModuleList,
    *,
    hidden_axes,
    token_axes,
    param_dtype=None,
    reduce_dtype=torch.float32,
    param_init=None,
    master="params",
    offload=None,
    comm=None,
) -> None:
    """One stage module laid out by spmd.parallelize on the mesh without pp, with what a pipeline changes: a
    split backward (`zero-bubble`, `zbv`) differentiates each parameter on its own in its weight pass
    (torch.autograd.grad from the input pass's intermediates), which a bucket's one gather node does not
    allow, so there parameters move one by one; and since several micro-batches run forward before their
    backward, the parameters outside the blocks are not kept gathered as a root unit (a copy per
    micro-batch) but move one by one, regathered in backward. Then the stage's activation checkpointing."""
    parallelize(
        stage,
        stage_mesh,
        rules,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        bucket=schedule not in SPLIT_BACKWARD,
        input_axes={0: hidden_axes if not info.first else token_axes, "targets": token_axes, "positions": token_axes},
        param_init=param_init,
        master=master,
        offload=offload,
        comm=comm,
    )
    drop_root_unit(getattr(stage, STATE_ATTR), stage)
    getattr(stage, STATE_ATTR).outputs_local = True  # the stage hands torch's pipelining local tensors
    checkpoint_stage(stage, info, every, blocks)


def checkpoint_stage(stage: nn.Module, info, every: int, blocks: nn.ModuleList) -> None:
    """Checkpoints the stage's blocks whose index in the whole model (`blocks`) is a multiple of `every` (0:
    none), the blocks apply_activation_checkpointing picks on the unsplit model."""
    for i in info.blocks:
        if every and i % every == 0:
            checkpoint_block(stage, blocks[i])


def check_no_shared_params(model, split):
    blocks = model.get_submodule(split.block_path)
    owner = {}
    for info in split.stages:
        mods = [blocks[i] for i in info.blocks] + [
            model.get_submodule(n) for n in (split.pre if info.first else []) + (split.post if info.last else [])
        ]
        for m in mods:
            for name, p in m.named_parameters():
                if owner.setdefault(id(p), info.index) != info.index:
                    raise ValueError(
                        f"parameter {name!r} is shared by pipeline stages {owner[id(p)]} and "
                        f"{info.index} (tied embeddings?); untie it to split the model into stages"
                    )


def release_others(model, split, rank, held):
    """Frees the parameters of stages this rank does not run (`held`: stage -> modules outside the blocks)."""
    blocks = model.get_submodule(split.block_path)
    mine = {name for s in split.stages_of_rank(rank) for name in held[s.index]}
    for info in split.stages:
        if info.rank == rank:
            continue
        for i in info.blocks:
            blocks[i].to("meta")
        for name in held[info.index]:
            if name not in mine:
                model.get_submodule(name).to("meta")
