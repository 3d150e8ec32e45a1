"""Pipeline parallelism over the `pp` mesh axis: torch's schedules running stages that spmd lays out.

    pipe = spmd.build_pipeline(model, mesh, rules, schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())        # this rank's stages, under the model's names
    loss = pipe.step(tokens, targets)                  # forward + backward of all micro-batches; same on every rank
    pipe.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

`split_stages` cuts the blocks into pp * virtual_stages stages of balanced cost; each rank builds its stage
modules (`stage.StageModule`) and lays each out with `spmd.parallelize` on the mesh without the pp
dim (dp, fsdp, tp, sp work inside a stage exactly as without pipelining). torch.distributed.pipelining
runs the schedule: `PipelineStage` sends and receives the local activations and gradients between
neighbouring pp ranks, and the schedule (`gpipe`, `1f1b`, `interleaved-1f1b`, `zero-bubble`, `zbv`)
orders the micro-batches. The last stage computes the loss of each micro-batch (the model's `head`,
vocab-parallel cross-entropy on DTensor logits); it is scaled by 1/M so gradients are those of the mean
over the global batch, and the step's loss is broadcast over the pp group. Gradient reduction over
dp/fsdp runs once per step, in the last backward of each stage (the others run under spmd's no_sync).
"""
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..layout.annotate import fake_copy
from ..layout.blocks import find_blocks
from ..layout.rules import local_shape
from ..runtime.checkpointing import checkpoint_block, parse_mode
from ..runtime.parallelize import parallelize
from ..runtime.state import STATE_ATTR
from .runtime import PipelineRuntime, default_microbatches, validate_pipeline
from .split import split_stages
from .stage import LocalModel, StageModule, has_parts

__all__ = ["Pipeline", "build_pipeline", "checkpoint_stage", "without_pp"]


def without_pp(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """(mesh with a pp dim and at least one other, the submesh without pp)."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "pp")
    if not names:  # a pp-only mesh: spmd.parallelize needs a mesh to lay the stage out on
        mesh = init_device_mesh(mesh.device_type, (mesh.size(), 1), mesh_dim_names=("pp", "dp"))
        names = ("dp",)
    return mesh, mesh[names]


def _make_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class SpmdPipelineStage(PipelineStage):
        """Reduces gradients only in the last backward of a step: the others run under spmd's no_sync."""
        pipeline = None

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            state = getattr(self.submod, STATE_ATTR)
            state.sync = bool(last_backward) and self.pipeline._sync
            try:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            finally:
                state.sync = True

    return SpmdPipelineStage


class Pipeline(PipelineRuntime):
    """This rank's stages of a pipeline-parallel model, laid out by spmd, and the schedule that runs them
    (see build_pipeline). `stage_modules`: this rank's StageModules; `module`: their union (LocalModel)."""

    def __init__(self, model, mesh, stage_mesh, rules, split, schedule, microbatches, stage_modules, param_dtype,
                 meta):
        super().__init__(mesh, split, schedule, microbatches,
                         LocalModel(model, split, [m.index for m in stage_modules]))
        self.stage_mesh, self.rules, self.param_dtype = stage_mesh, rules, param_dtype
        self.stage_modules = stage_modules
        self._meta = meta  # a meta-tensor copy of the model, for activation shapes
        self._shape = None

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0,
             sync: bool = True, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this rank's slice of the batch (the dp*fsdp slice, like the model's
        forward under spmd.parallelize) in `microbatches` micro-batches; gradients accumulate into the
        parameters' .grad, as the mean loss over the global batch times `loss_scale` would give them.
        `sync=False` leaves them unreduced over dp/fsdp (gradient accumulation over several steps).
        Returns the mean loss over the global batch, a plain tensor, the same on every rank. Under cp,
        tokens, targets and `positions` are this rank's zigzag share of the sequence (spmd.cp_slice)."""
        if self._schedule is None or tuple(tokens.shape) != self._shape:
            self._build_schedule(tokens)
        # targets reach the last stage's module as a keyword (every stage gets it; only the last uses it)
        extra = {} if positions is None else {"positions": positions}
        return self._run(tokens, targets, loss_scale, sync, targets=targets, **extra)

    def _build_schedule(self, tokens):
        if tokens.shape[0] % self.microbatches:
            raise ValueError(f"this rank's batch of {tokens.shape[0]} sequences does not divide into "
                             f"{self.microbatches} micro-batches")
        stage_cls = _make_stage_class()
        n_dp = self.rules.data_parallel_size(self.stage_mesh)
        mb_local = (tokens.shape[0] // self.microbatches,) + tuple(tokens.shape[1:])
        cp = dict(zip(self.stage_mesh.mesh_dim_names, self.stage_mesh.shape)).get("cp", 1)
        mb_global = (mb_local[0] * n_dp,) + ((mb_local[1] * cp,) if len(mb_local) > 1 else ()) + mb_local[2:]
        with torch.no_grad():
            h = type(self._meta).embed(self._meta, torch.zeros(mb_global, dtype=tokens.dtype, device="meta"))
        hidden_dtype = self.param_dtype or h.dtype
        hidden_local = local_shape(tuple(h.shape), self.stage_modules[0].hidden_axes, self.stage_mesh, self.rules)
        stages = []
        for module in self.stage_modules:
            # metadata only: shapes and dtypes of what this stage receives and sends (local tensors)
            hidden = torch.empty(hidden_local, dtype=hidden_dtype, device="meta", requires_grad=True)
            inp = torch.empty(mb_local, dtype=tokens.dtype, device="meta") if module.first else hidden
            out = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True) if module.last else hidden
            stage = stage_cls(module, module.index, self.split.n_stages, self._device(), input_args=(inp,),
                              output_args=(out,), group=self.pp_group)
            stage.pipeline = self
            stages.append(stage)
        self._make_schedule(stages, self._scaled_loss)
        self._shape = tuple(tokens.shape)


def build_pipeline(model: nn.Module, mesh: DeviceMesh, rules, schedule: str = "1f1b", microbatches: int | None = None,
                   virtual_stages: int = 1, loss_fn=None, param_dtype: torch.dtype | None = None,
                   reduce_dtype: torch.dtype | None = torch.float32, split_cost: str = "flops",
                   blocks: str | None = None, ac: str = "none", hidden_axes=("batch", "seq", "embed"),
                   token_axes=("batch", None), param_init=None) -> Pipeline:
    """Splits `model` into pp * virtual_stages stages, lays this rank's stages out on `mesh` without its pp
    dim, and returns the Pipeline that trains them. Call it on every rank with the same model (same seed).

    `microbatches` defaults to pp (2 * pp for interleaved schedules). `loss_fn(logits, targets)`, if given,
    replaces the model's own loss (`head(h, targets)`); it must return the mean over the micro-batch.
    `ac`: activation checkpointing of blocks, as spmd.apply_activation_checkpointing (`none`, `full`,
    `selective:N`, counted over the model's blocks). Parameters of stages on other ranks move to the meta
    device: each rank holds only its own stages. A model built on the meta device needs `param_init`
    (as spmd.parallelize): each rank then materialises only its stages' shards.
    """
    if "pp" not in mesh.mesh_dim_names:
        raise ValueError(f"build_pipeline needs a mesh with a 'pp' axis, got axes {mesh.mesh_dim_names}")
    pp = mesh.size(mesh.mesh_dim_names.index("pp"))
    microbatches = microbatches or default_microbatches(schedule, pp)
    try:
        n_blocks = len(find_blocks(model, blocks)[1])
    except ValueError as e:
        raise ValueError(f"cannot split {type(model).__name__} into pipeline stages: {e}") from None
    validate_pipeline(pp, schedule, microbatches, virtual_stages, n_blocks)
    every = parse_mode(ac)
    if not has_parts(model):
        raise ValueError(
            f"{type(model).__name__} has no embed/block_inputs/head methods, which spmd's pipeline stages run "
            f"(see spmd/pipeline/stage.py). spmd lays stages out through module hooks, which a traced graph "
            f"(torch.distributed.pipelining.pipeline) no longer has; for a pp-only mesh such a model can use "
            f"spmd.build_traced_pipeline")
    full_mesh, stage_mesh = without_pp(mesh)
    style = "v" if schedule == "zbv" else "loop"
    split = split_stages(model, pp * virtual_stages, split_cost, blocks, pp=pp, style=style)
    _check_no_shared_params(model, split)
    rank = full_mesh.get_local_rank("pp")
    meta = fake_copy(model, None)
    modules = []
    for info in split.stages_of_rank(rank):
        stage = StageModule(model, split, info.index, hidden_axes, loss_fn)
        parallelize(stage, stage_mesh, rules, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                    input_axes={0: hidden_axes if not info.first else token_axes, "targets": token_axes,
                                "positions": token_axes},
                    param_init=param_init)
        checkpoint_stage(stage, info, every)
        modules.append(stage)
    _release_others(model, split, rank)
    return Pipeline(model, full_mesh, stage_mesh, rules, split, schedule, microbatches, modules, param_dtype, meta)


def checkpoint_stage(stage: nn.Module, info, every: int) -> None:
    """Checkpoints the stage's blocks whose index in the whole model is a multiple of `every` (0: none), the
    blocks apply_activation_checkpointing picks on the unsplit model."""
    for i, block in zip(info.blocks, stage.__dict__["_blocks"]):
        if every and i % every == 0:
            checkpoint_block(stage, block)


def _check_no_shared_params(model, split):
    blocks = model.get_submodule(split.block_path)
    owner = {}
    for info in split.stages:
        mods = [blocks[i] for i in info.blocks] + [model.get_submodule(n) for n in
                                                  (split.pre if info.first else []) + (split.post if info.last else [])]
        for m in mods:
            for name, p in m.named_parameters():
                if owner.setdefault(id(p), info.index) != info.index:
                    raise ValueError(f"parameter {name!r} is shared by pipeline stages {owner[id(p)]} and "
                                     f"{info.index} (tied embeddings?); untie it to split the model into stages")


def _release_others(model, split, rank):
    """Frees the parameters of stages this rank does not run."""
    blocks = model.get_submodule(split.block_path)
    for info in split.stages:
        if info.rank == rank:
            continue
        for i in info.blocks:
            blocks[i].to("meta")
        for name in (split.pre if info.first else []) + (split.post if info.last else []):
            if not any(s.rank == rank and (s.first and name in split.pre or s.last and name in split.post)
                       for s in split.stages):
                model.get_submodule(name).to("meta")
