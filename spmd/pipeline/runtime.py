"""The parts of a pipeline that do not depend on how stages are built: schedule names, their theoretical
bubble, the configuration checks, and the runtime (torch's schedule over the micro-batches, the loss
broadcast over pp, gradient clipping across stages) shared by spmd's stages (build.py) and traced
ones (traced.py)."""

import inspect
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..runtime.parameters.host import compute_device

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
INTERLEAVED = ("interleaved-1f1b", "zero-bubble", "zbv")  # several stages per rank
SPLIT_BACKWARD = ("zero-bubble", "zbv")  # the weights' gradients in a pass of their own

__all__ = [
    "SCHEDULES",
    "INTERLEAVED",
    "SPLIT_BACKWARD",
    "default_microbatches",
    "bubble_fraction",
    "validate_pipeline",
    "PipelineRuntime",
]


def default_microbatches(schedule: str, pp: int) -> int:
    """pp micro-batches, 2 * pp for interleaved schedules."""
    return pp * (2 if schedule in INTERLEAVED else 1)


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules as s

    return {
        "gpipe": s.ScheduleGPipe,
        "1f1b": s.Schedule1F1B,
        "interleaved-1f1b": s.ScheduleInterleaved1F1B,
        "zero-bubble": s.ScheduleInterleavedZeroBubble,
        "zbv": s.ScheduleZBVZeroBubble,
    }[name]


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Theoretical idle fraction of a step: (p-1)/(m+p-1) for GPipe and 1F1B, divided by v when interleaved.
    Zero-bubble schedules fill the warm-up and cool-down with weight-gradient work; with equal forward,
    input-gradient and weight-gradient times (ZB-H1) the idle time shrinks to a third: (p-1)/(3m+p-1)/v."""
    p, m, v = pp, microbatches, virtual_stages
    if schedule in SPLIT_BACKWARD:
        return (p - 1) / (3 * m + p - 1) / v
    return (p - 1) / (m + p - 1) / (v if schedule in INTERLEAVED else 1)


def validate_pipeline(
    pp: int,
    schedule: str,
    microbatches: int,
    virtual_stages: int = 1,
    n_blocks: int | None = None,
    batch_size: int | None = None,
    data_parallel: int = 1,
    world: int | None = None,
) -> None:
    """Raises ValueError for a pipeline configuration that cannot run; call it on every rank before any
    collective. `batch_size` is the global batch in sequences, `data_parallel` the dp*fsdp size."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if pp < 2:
        raise ValueError(f"pipeline parallelism needs pp >= 2, got pp={pp}; without a pp axis use spmd.parallelize")
    if world is not None and world % pp:
        raise ValueError(f"pp={pp} does not divide the world size {world}")
    if schedule not in INTERLEAVED and virtual_stages != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank; virtual_stages={virtual_stages} needs "
            f"interleaved-1f1b, zero-bubble or zbv"
        )
    if schedule == "zbv" and virtual_stages != 2:
        raise ValueError(
            f"schedule 'zbv' places exactly two stages per rank in a V: use virtual_stages=2, got {virtual_stages}"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"schedule '1f1b' needs at least as many micro-batches as stages: microbatches={microbatches} < pp={pp}"
        )
    if schedule in ("interleaved-1f1b", "zero-bubble") and microbatches % pp:
        raise ValueError(
            f"schedule {schedule!r} needs the number of micro-batches to be a multiple of pp: "
            f"microbatches={microbatches}, pp={pp}"
        )
    n_stages = pp * virtual_stages
    if n_blocks is not None and n_stages > n_blocks:
        raise ValueError(
            f"pp={pp} x virtual_stages={virtual_stages} = {n_stages} stages but the model has only "
            f"{n_blocks} blocks; each stage needs at least one"
        )
    if batch_size is not None and batch_size % (data_parallel * microbatches):
        raise ValueError(
            f"batch size {batch_size} does not divide into {microbatches} micro-batches on each of "
            f"{data_parallel} data-parallel ranks (needs a multiple of {data_parallel * microbatches})"
        )


class PipelineRuntime:
    """What every pipeline offers the trainer: this rank's parameters under the model's names, the step
    (torch's schedule over the micro-batches, the loss broadcast over pp), and clipping across stages."""

    def __init__(self, mesh, split, schedule, microbatches, module):
        self.mesh, self.split = mesh, split
        self.schedule_name, self.microbatches = schedule, microbatches
        self.pp_group = mesh.get_group("pp")
        self.pp_rank, self.pp = mesh.get_local_rank("pp"), mesh.size(mesh.mesh_dim_names.index("pp"))
        self.module = module
        self.last_stage_rank = split.stages[-1].rank
        self.stages: list = []  # torch's PipelineStage objects of this rank, once built (benchmarks time them)
        self._schedule = None
        self._sync, self._scale = True, 1.0

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the norm of all gradients of the whole model (every stage, every mesh axis); returns it."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        counted = [p.grad for p in self._norm_parameters() if p.grad is not None]
        local = torch.nn.utils.get_total_norm(counted, norm_type, foreach=None) if counted else torch.zeros(())
        local = local.full_tensor() if isinstance(local, DTensor) else local
        local = local.float().to(self._device())
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pp_group)
            total = local
        else:
            local = local**norm_type
            dist.all_reduce(local, group=self.pp_group)
            total = local ** (1.0 / norm_type)
        coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def _norm_parameters(self):
        """The parameters whose gradients this rank counts in the norm (each of the model's once over pp)."""
        return self.parameters()

    def _device(self):
        return compute_device(self.mesh)

    def _scaled_loss(self, loss, target):
        return loss * (self._scale / self.microbatches)

    def _make_schedule(self, stages, loss_fn):
        self.stages = stages
        cls = _schedule_class(self.schedule_name)
        self._schedule = cls(
            stages if self.schedule_name in INTERLEAVED else stages[0],
            self.microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )  # we scale the loss by 1/M ourselves
        self._return_outputs_arg = "return_outputs" in inspect.signature(self._schedule.step).parameters

    def _run(self, inputs, target, loss_scale, sync, backward: bool = True, **kwargs) -> torch.Tensor:
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"this rank's batch of {inputs.shape[0]} sequences does not divide into "
                f"{self.microbatches} micro-batches"
            )
        self._sync, self._scale = sync, float(loss_scale)
        losses: list = []
        if self._return_outputs_arg:
            kwargs["return_outputs"] = False
        # eval(): the same schedule's forwards only (torch skips its backward actions and sends no gradients)
        (self._schedule.step if backward else self._schedule.eval)(inputs, target=target, losses=losses, **kwargs)
        device = self._device()
        if losses:
            loss = torch.stack([l.detach().float() for l in losses]).sum().to(device) / self._scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        extra = self._stage_losses()
        if extra is None:
            dist.broadcast(loss, group=self.pp_group, group_src=self.last_stage_rank)
        else:  # the loss terms of stages before the last (router losses) join the last stage's loss
            loss += extra.float().to(device)
            dist.all_reduce(loss, group=self.pp_group)
        return loss

    def _stage_losses(self) -> torch.Tensor | None:
        """Loss terms this rank's stages before the last added in this step (mean over micro-batches), or
        None when the model has none (then the last stage's loss is the step's)."""
        return None
