"""How a training run is set up from its config: this process's place in the world, the model laid out on
the mesh (or a pipeline's stages), the optimizer's parameter groups, and the checkpoint to resume from."""

from __future__ import annotations

import os
import sys

import torch

import spmd
from spmd import checkpoint
from spmd.layout.dtypes import DTYPES

from .config import TrainConfig

__all__ = ["ranks", "build_model", "param_groups", "adamw", "optimizer", "resume_point"]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights), none on norm weights."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """The trainer's AdamW over `param_groups`. Its step runs fused: one kernel per device and dtype for the
    whole update (torchtitan's default), where foreach kernels take one call per state update and torch's CPU
    default steps tensor by tensor; each of those calls on DTensor parameters pays DTensor's dispatch, which
    the fused call skips (it updates the local shards: spmd.runtime.fused_step). On tiny (one process) the
    step takes 0.78 ms fused against 1.84 ms foreach in plain PyTorch; on spmd's DTensors 1.08 ms fused
    (1.41 ms through DTensor's dispatch) against 2.71 ms foreach."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """`--optimizer`: AdamW (`adamw`), or spmd.Muon at --muon-lr on the hidden matrices and AdamW at --lr with
    --weight-decay on embeddings, head, norms. Each group's `lr_scale` keeps its peak lr under the schedule.
    `onebit-adam`: spmd.OneBitAdam with AdamW's betas, --onebit-warmup exact steps."""
    if cfg.optimizer == "onebit-adam":
        return spmd.OneBitAdam(
            model, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, warmup=cfg.onebit_warmup
        )
    if cfg.optimizer != "muon":
        return adamw(model, cfg)
    opt = spmd.Muon(
        model, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, adamw_lr=cfg.lr, adamw_weight_decay=cfg.weight_decay
    )
    for group in opt.param_groups:
        group["lr_scale"] = group["lr"] / cfg.lr
    return opt


def ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def build_model(cfg: TrainConfig, model_cfg, world: int, device: torch.device):
    """(model, mesh, dp_rank, dp_size, pipe). World 1: plain PyTorch, no process group. With a pp axis,
    `pipe` is the spmd.Pipeline running this rank's stages and `model` holds their parameters."""
    sizes = cfg.mesh_sizes(world)
    param_dtype = None if cfg.dtype == "fp32" else DTYPES[cfg.dtype]
    # on a mesh the model is built on the meta device and each rank materialises only its shards (of its
    # pipeline stages), one full tensor at a time, with the values a one-device build has
    torch.manual_seed(cfg.seed)
    with torch.device("meta" if world > 1 else device):
        model = model_cfg.build()
    if cfg.float8:
        float8_ready = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
        spmd.float8_training(model, emulate=not float8_ready)
    if world == 1:
        return model, None, 0, 1, None
    mesh = spmd.make_mesh(sizes, device_type=device.type)
    rules = cfg.rules()
    pipe = None
    if sizes.get("pp", 1) > 1:
        with torch.device(device):
            pipe = spmd.build_pipeline(
                model,
                mesh,
                rules,
                schedule=cfg.pp_schedule,
                microbatches=cfg.pipeline_microbatches(world),
                virtual_stages=cfg.virtual_stages,
                param_dtype=param_dtype,
                ac=cfg.ac,
                param_init=model.initializer(cfg.seed),
                master=cfg.master,
                offload=cfg.offload or None,
                comm=cfg.comm(),
            )
        mesh, model = pipe.mesh, pipe.module
    else:
        with torch.device(device):
            spmd.parallelize(
                model,
                mesh,
                rules,
                param_dtype=param_dtype,
                param_init=model.initializer(cfg.seed),
                master=cfg.master,
                offload=cfg.offload or None,
                comm=cfg.comm(),
            )
    return model, mesh, rules.data_parallel_rank(mesh), rules.data_parallel_size(mesh), pipe


def resume_point(cfg: TrainConfig, rank: int):
    """The newest checkpoint in --ckpt-dir whose files match their checksums (collective), or None."""
    found, rejected = checkpoint.newest_intact(cfg.ckpt_dir)
    if rank == 0:
        for path, problems in rejected:
            print(
                f"[launch.train] --resume: checkpoint {path} is damaged ({'; '.join(problems)}); "
                f"{'falling back to ' + str(found) if found else 'looking further back'}",
                file=sys.stderr,
                flush=True,
            )
        if found is None and not rejected:
            print(f"[launch.train] --resume: no checkpoint in {cfg.ckpt_dir} yet, starting from step 0", flush=True)
    if found is None and rejected:
        raise ValueError(
            f"--resume: no intact checkpoint in {cfg.ckpt_dir}: "
            + "; ".join(f"{p.name}: {', '.join(pr)}" for p, pr in rejected)
            + f". Restore the damaged files, or move {cfg.ckpt_dir} aside to start from step 0"
        )
    return found
