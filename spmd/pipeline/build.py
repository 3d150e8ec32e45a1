"""Pipeline parallelism over the `pp` mesh axis: torch's schedules running stages that spmd lays out.

    pipe = spmd.build_pipeline(model, mesh, rules, schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())        # this rank's stages, under the model's names
    loss = pipe.step(tokens, targets)                  # forward + backward of all micro-batches; same on every rank
    pipe.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

`split_stages` cuts the blocks into pp * virtual_stages stages of balanced cost; each rank builds its stage
modules (`stage.StageModule` for a model with embed/block_inputs/head parts, else a shell of the model
running its own forward cut at the blocks, `cut.cut_stage`) and lays each out with `spmd.parallelize` on the mesh
without the pp dim (dp, fsdp, tp, sp work inside a stage exactly as without pipelining). torch.distributed.pipelining
runs the schedule: `PipelineStage` sends and receives the local activations and gradients between
neighbouring pp ranks, and the schedule (`gpipe`, `1f1b`, `interleaved-1f1b`, `zero-bubble`, `zbv`)
orders the micro-batches. The last stage computes the loss of each micro-batch (the model's `head`,
vocab-parallel cross-entropy on DTensor logits); it is scaled by 1/M so gradients are those of the mean
over the global batch, and the step's loss is broadcast over the pp group (summed over it when the model's
blocks add loss terms of their own, which each stage adds: stage.py). Gradient reduction over
dp/fsdp runs once per step, in the last backward of each stage (the others run under spmd's no_sync); a
weight tied across the first and last stage then has its two gradients summed over those pp ranks.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..layout.blocks import find_blocks
from ..layout.rules import local_shape
from ..runtime.state import STATE_ATTR
from ..runtime.transforms.checkpointing import parse_mode
from .cut import cut_stage, plan_cut, sum_tied_grads, trace_uses
from .runtime import PipelineRuntime, default_microbatches, validate_pipeline
from .shapes import fake_model, hidden_of
from .split import split_stages
from .stage import LocalModel, NamedParams, StageModule, has_blocks_loss, has_parts
from .stage_layout import check_no_shared_params, lay_out_stage, release_others, without_pp

__all__ = ["Pipeline", "build_pipeline"]


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
    (see build_pipeline). `stage_modules`: this rank's stage modules (StageModules, or shells of a model cut
    by spmd.pipeline.cut); `module`: their union under the model's names."""

    def __init__(
        self,
        mesh,
        stage_mesh,
        rules,
        split,
        schedule,
        microbatches,
        stage_modules,
        module,
        param_dtype,
        shadow,
        hidden_axes,
        cut=None,
    ):
        super().__init__(mesh, split, schedule, microbatches, module)
        self.stage_mesh, self.rules, self.param_dtype = stage_mesh, rules, param_dtype
        self.stage_modules, self.hidden_axes = stage_modules, tuple(hidden_axes)
        self.stage_infos = split.stages_of_rank(self.pp_rank)  # in the order of stage_modules
        self._shadow = shadow  # a fake-tensor copy of the model and its mode, for activation shapes
        self._shape = None
        self._cut, self._tie_group = cut, None
        if cut is not None and cut.tied:  # the first and last stage's pp ranks, for each coordinate of the others
            self._tie_group = _pp_pair_group(self.mesh, cut.tie_ranks)

    @property
    def laid_out_parts(self) -> list:
        """The modules spmd.parallelize laid out (this rank's stages): what spmd.shard_optimizer and
        spmd.reduce_gradients find their layouts on."""
        return list(self.stage_modules)

    def step(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_scale: float = 1.0,
        sync: bool = True,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of this rank's slice of the batch (the dp*fsdp slice, like the model's
        forward under spmd.parallelize) in `microbatches` micro-batches; gradients accumulate into the
        parameters' .grad, as the mean loss over the global batch times `loss_scale` would give them.
        `sync=False` leaves them unreduced over dp/fsdp (gradient accumulation over several steps).
        Returns the mean loss over the global batch, a plain tensor, the same on every rank. Under cp,
        tokens, targets and `positions` are this rank's zigzag share of the sequence (spmd.cp_slice)."""
        if self._schedule is None or tuple(tokens.shape) != self._shape:
            self._build_schedule(tokens)
        for module in self.stage_modules:
            module.loss_weight = loss_scale / self.microbatches  # what _scaled_loss weighs a micro-batch's loss by
        # targets reach the last stage's module as a keyword (every stage gets it; only the last uses it)
        extra = {} if positions is None else {"positions": positions}
        loss = self._run(tokens, targets, loss_scale, sync, targets=targets, **extra)
        if sync and self._tie_group is not None:
            sum_tied_grads(dict(self.named_parameters()), self._cut, self._tie_group)
        return loss

    def evaluate(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean loss over the global batch, as `step` returns it, from forwards only: the schedule's
        eval() under no_grad, no activations kept for a backward and no gradients touched."""
        if self._schedule is None or tuple(tokens.shape) != self._shape:
            self._build_schedule(tokens)
        extra = {} if positions is None else {"positions": positions}
        with torch.no_grad():
            return self._run(tokens, targets, 1.0, True, backward=False, targets=targets, **extra)

    def _stage_losses(self):
        """This rank's stages' own loss terms (a model's blocks_loss) before the last stage, as the mean over
        the micro-batches; None for a model without them."""
        if not has_blocks_loss(self._shadow[0]):
            return None
        values = [v for v in (m.take_reported() for m in self.stage_modules) if v is not None]
        return torch.stack(values).sum() / self.microbatches if values else torch.zeros(())

    def _norm_parameters(self):
        """A tied parameter counts once in the gradient norm: on the first stage."""
        skip = set(self._cut.tied) if self._tie_group is not None and self.pp_rank != self._cut.tie_ranks[0] else set()
        return [p for n, p in self.named_parameters() if n not in skip]

    def _build_schedule(self, tokens):
        if tokens.shape[0] % self.microbatches:
            raise ValueError(
                f"this rank's batch of {tokens.shape[0]} sequences does not divide into "
                f"{self.microbatches} micro-batches"
            )
        stage_cls = _make_stage_class()
        n_dp = self.rules.data_parallel_size(self.stage_mesh)
        mb_local = (tokens.shape[0] // self.microbatches,) + tuple(tokens.shape[1:])
        cp = dict(zip(self.stage_mesh.mesh_dim_names, self.stage_mesh.shape)).get("cp", 1)
        mb_global = (mb_local[0] * n_dp,) + ((mb_local[1] * cp,) if len(mb_local) > 1 else ()) + mb_local[2:]
        h = hidden_of(*self._shadow, self.split.block_path, torch.zeros(mb_global, dtype=tokens.dtype, device="meta"))
        hidden_dtype = self.param_dtype or h.dtype
        hidden_local = local_shape(tuple(h.shape), self.hidden_axes, self.stage_mesh, self.rules)
        stages = []
        for module, info in zip(self.stage_modules, self.stage_infos):
            # metadata only: shapes and dtypes of what this stage receives and sends (local tensors)
            hidden = torch.empty(hidden_local, dtype=hidden_dtype, device="meta", requires_grad=True)
            inp = torch.empty(mb_local, dtype=tokens.dtype, device="meta") if info.first else hidden
            out = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True) if info.last else hidden
            stage = stage_cls(
                module,
                info.index,
                self.split.n_stages,
                self._device(),
                input_args=(inp,),
                output_args=(out,),
                group=self.pp_group,
            )
            stage.pipeline = self
            stages.append(stage)
        self._make_schedule(stages, self._scaled_loss)
        self._shape = tuple(tokens.shape)


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    rules,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int = 1,
    loss_fn=None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    split_cost: str = "flops",
    blocks: str | None = None,
    ac: str = "none",
    hidden_axes=("batch", "seq", "embed"),
    token_axes=("batch", None),
    param_init=None,
    master: str = "params",
    offload=None,
    comm=None,
) -> Pipeline:
    """Splits `model` into pp * virtual_stages stages, lays this rank's stages out on `mesh` without its pp
    dim, and returns the Pipeline that trains them. Call it on every rank with the same model (same seed).

    A model with embed/block_inputs/head parts gets StageModules (spmd/pipeline/stage.py); any other has its
    own forward cut at its blocks (spmd/pipeline/cut.py), called as `model(tokens, targets)` -> the loss (or
    a ModelOutput, dict or tuple holding it). `microbatches` defaults to pp (2 * pp for interleaved
    schedules). `loss_fn(output, targets)`, if given, replaces the model's own loss (`head(h, targets)`, or
    `model(tokens, targets)`: then it takes `model(tokens)`); it must return the mean over the micro-batch.
    `ac`: activation checkpointing of blocks, as spmd.apply_activation_checkpointing (`none`, `full`,
    `selective:N`, counted over the model's blocks). Parameters of stages on other ranks move to the meta
    device: each rank holds only its own stages. A model built on the meta device needs `param_init`
    (as spmd.parallelize): each rank then materialises only its stages' shards. `master` and `offload`: where
    fp32 master weights and optimizer states live, and `comm` the precision each stage's gathers and reductions
    travel in, as spmd.parallelize's. ZeRO stages are the rules' as
    without pp: spmd.shard_optimizer(pipeline, opt) makes the optimizer step on the optimizer map's shards.
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
    full_mesh, stage_mesh = without_pp(mesh)
    style = "v" if schedule == "zbv" else "loop"
    traced = None if has_parts(model) else trace_uses(model, find_blocks(model, blocks)[0], loss_fn)
    split = split_stages(model, pp * virtual_stages, split_cost, blocks, pp=pp, style=style)
    rank = full_mesh.get_local_rank("pp")
    shadow = fake_model(model)
    if traced is None:
        check_no_shared_params(model, split)
        cut, make = None, lambda info: StageModule(model, split, info.index, hidden_axes, loss_fn)
    else:  # the model's own forward, cut at block boundaries
        cut = plan_cut(model, split, traced)
        make = lambda info: cut_stage(model, split, info.index, cut, hidden_axes, loss_fn, param_dtype)  # noqa: E731
    modules = []
    for info in split.stages_of_rank(rank):
        stage = make(info)
        lay_out_stage(
            stage,
            info,
            stage_mesh,
            rules,
            schedule,
            every,
            model.get_submodule(split.block_path),
            hidden_axes=hidden_axes,
            token_axes=token_axes,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            param_init=param_init,
            master=master,
            offload=offload,
            comm=comm,
        )
        modules.append(stage)
    held = (
        {i: (split.pre if s.first else []) + (split.post if s.last else []) for i, s in enumerate(split.stages)}
        if cut is None
        else cut.held
    )
    release_others(model, split, rank, held)
    union = (
        LocalModel(model, split, [s.index for s in split.stages_of_rank(rank)])
        if cut is None
        else NamedParams(dict(p for m in modules for p in m.named_parameters()).items())
    )
    return Pipeline(
        full_mesh,
        stage_mesh,
        rules,
        split,
        schedule,
        microbatches,
        modules,
        union,
        param_dtype,
        shadow,
        hidden_axes,
        cut,
    )


def _pp_pair_group(mesh, pp_ranks):
    """The process group of the two pp ranks `pp_ranks` at this rank's coordinate of the other mesh dims
    (the pp group itself when pp is 2); every rank creates every such group, as new_group requires."""
    if len(set(pp_ranks)) == mesh.size(mesh.mesh_dim_names.index("pp")):
        return mesh.get_group("pp")
    pp_dim = mesh.mesh_dim_names.index("pp")
    grid = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim])
    mine = None
    for row in grid.tolist():
        ranks = [row[r] for r in pp_ranks]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
