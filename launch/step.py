"""One step of the trainer's loop (launch.train): the micro-batches' forward and backward, the clipped optimizer
step and the step's metrics row (`train_step`), then what follows a step: the stop and save-failure agreement, the
checkpoint when due, and the end of a diverged run (`end_of_step`). `Run` is what the loop carries."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

import models
import spmd
from spmd import checkpoint
from spmd.analysis.record import CollectiveRecorder
from spmd.layout.dtypes import DTYPES

from . import schedule
from .data import model_inputs
from .metrics import peak_mem_bytes
from .nonfinite import Diverged
from .stopping import stop_everywhere

__all__ = ["Run", "train_step", "end_of_step"]


@dataclass
class Run:
    """A training run's parts, made by launch.train's set-up; `comm`: the bytes of the last recorded step."""

    cfg: object
    model_cfg: object
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    mesh: object
    pipe: object
    device: torch.device
    world: int
    code: str
    loader: object
    scaler: object
    bad: object
    start: int = 0
    metrics: object = None
    validator: object = None
    profiler: object = None
    stop: object = None
    saver: object = None
    comm: int = 0
    params: list = field(default_factory=list)

    @property
    def max_norm(self) -> float:
        return self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf

    def close(self) -> None:
        """Releases what the set-up took: the profiler, the signal handlers, the metrics file."""
        self.profiler.close()
        self.stop.uninstall()
        self.metrics.close()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _router_metrics(model) -> dict:
    """A mixture of experts' router load in the step's last micro-batch (collective): its router losses
    summed over layers, and tokens per expert, one list per layer. Empty for other models."""
    if not hasattr(model, "router_stats"):
        return {}
    stats = model.router_stats()
    return {
        "aux_loss": float(_full(stats["aux_loss"])),
        "tokens_per_expert": _full(stats["tokens_per_expert"]).tolist(),
    }


def forward_backward(run: Run, micro: list) -> torch.Tensor:
    """Forward and backward of each micro-batch (gradient reduction skipped on all but the last under
    `spmd.no_sync`); returns the step's mean loss, on the device."""
    model, mesh, pipe, scale = run.model, run.mesh, run.pipe, run.scaler.scale
    autocast = run.world == 1 and run.cfg.dtype != "fp32"
    loss_sum = torch.zeros((), device=run.device)
    for j, (x, y) in enumerate(micro):
        last = j == len(micro) - 1
        if pipe is not None:  # forward and backward of every pipeline micro-batch
            x, y, *positions = model_inputs(x, y, mesh)
            positions = positions[0] if positions else None
            loss = pipe.step(x, y, loss_scale=scale / len(micro), sync=last, positions=positions)
            loss_sum += loss.float() / len(micro)
            continue
        sync = contextlib.nullcontext() if (last or mesh is None) else spmd.no_sync(model)
        amp = torch.autocast(run.device.type, dtype=DTYPES[run.cfg.dtype]) if autocast else contextlib.nullcontext()
        with sync:  # no_sync covers the backward: that is where gradients are reduced
            with amp:
                loss = model(*model_inputs(x, y, mesh)) / len(micro)
            (loss * scale).backward()
        loss_sum += loss.detach().float()
    return loss_sum


def optimizer_step(run: Run, step: int, loss_sum: torch.Tensor) -> tuple[float, float]:
    """Reduces what backward held (--zero 1), unscales, clips by the global norm and steps, unless the loss or
    the norm is not finite (launch.nonfinite); returns (loss, gradient norm)."""
    model, opt, pipe = run.model, run.opt, run.pipe
    if run.mesh is not None:  # --zero 1: the gradients backward held, reduced before clipping
        spmd.reduce_gradients(model if pipe is None else pipe)
    if run.scaler.enabled:
        for p in run.params:
            if p.grad is not None:
                p.grad.div_(run.scaler.scale)
    if pipe is not None:  # the norm over every stage, not only this rank's
        grad_norm = _full(pipe.clip_grad_norm_(run.max_norm))
    elif isinstance(opt, spmd.OneBitAdam):  # after warm-up: the local gradients, never reduced
        grad_norm = _full(opt.clip_grad_norm_(run.max_norm))
    else:
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(run.params, run.max_norm, foreach=None))
    loss_value = float(loss_sum)  # synchronises with the device
    good = run.bad.check(step + 1, loss_value, float(grad_norm))
    if good:
        opt.step()
    run.scaler.update(good)
    opt.zero_grad(set_to_none=True)
    return loss_value, float(grad_norm)


def train_step(run: Run, step: int) -> dict:
    """Step `step + 1`: the scheduled learning rate, forward and backward, the optimizer step; its metrics row."""
    cfg, device = run.cfg, run.device
    run.profiler.before(step + 1)
    lr = schedule.lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
    schedule.set_lr(run.opt, lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    micro = run.loader.next()
    # the first and the last step are recorded (a dispatch mode: 20-30% of a tiny model's CPU step); the steps
    # between issue the same collectives, layouts and shapes being fixed, and the last step's measurement shows it
    recorded = run.mesh is not None and (step == run.start or step + 1 == cfg.steps)
    recorder = CollectiveRecorder(run.mesh) if recorded else None
    with recorder if recorder is not None else contextlib.nullcontext():
        loss, grad_norm = optimizer_step(run, step, forward_backward(run, micro))
    step_time = time.perf_counter() - t0
    if recorder is not None:
        run.comm = sum(r.bytes for r in recorder.records)
    extra = {**_router_metrics(run.model), **run.validator.metrics(step + 1)}  # in this order: eval replaces the first
    row = run.metrics.record(
        step + 1, loss, grad_norm, lr, step_time, peak_mem_bytes(device), run.comm, run.bad.skipped, extra
    )
    for path in run.profiler.after(step + 1):
        run.metrics.write(f"[launch.train] profile: {path}" + (" (one per rank)" if run.world > 1 else ""))
    return row


def end_of_step(run: Run, step: int) -> bool:
    """After step `step`: a checkpoint when due; raises Diverged after too many bad steps; whether to stop
    (a signal on any rank)."""
    cfg, saver = run.cfg, run.saver
    # one all-reduce: a stop asked on any rank, a background save failed on any rank
    stopping, save_failed = stop_everywhere(run.stop.requested, run.device, saver is not None and saver.failed())
    if save_failed:
        saver.wait()  # raises the writer's error, on every rank at this same step
    diverged = run.bad.exhausted
    due = cfg.ckpt_dir and (
        step == cfg.steps or stopping or diverged or (cfg.ckpt_every and step % cfg.ckpt_every == 0)
    )
    path = _save(run, step) if due else None
    if diverged:
        if saver:
            saver.wait()  # the message names the checkpoint: it must be there
        raise Diverged(run.bad.message(step, str(path) if path else None))
    if stopping:
        run.metrics.write(
            f"[launch.train] stopped by signal after step {step}"
            + ("" if cfg.ckpt_dir else " (no --ckpt-dir: nothing saved)")
        )
    return stopping


def _save(run: Run, step: int):
    cfg, saver = run.cfg, run.saver
    meta = {
        "config": cfg.to_dict(),
        "model_config": run.model_cfg.to_dict(),
        "model": models.entry(run.model_cfg).name,
        "data": run.loader.state_dict(),
        "loss_scale": run.scaler.state_dict(),
        "bad_steps": run.bad.state_dict(),
        "mesh": cfg.mesh_sizes(run.world),
        "code_version": run.code,
    }
    model_state, optim_state = checkpoint.model_state(run.model), checkpoint.optim_state(run.model, run.opt)
    path = (saver.save if saver else checkpoint.save)(
        cfg.ckpt_dir, step, model_state, optim_state, meta=meta, keep=cfg.ckpt_keep or None
    )
    run.metrics.write(
        f"[launch.train] step {step}: checkpoint {path}" + (" (writing in the background)" if saver else "")
    )
    return path
