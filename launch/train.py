"""The trainer: `torchrun --standalone --nproc-per-node N -m launch.train [flags]` (or `python -m launch.train`).

One step: set the scheduled learning rate; for each of the K micro-batches of this data-parallel rank run
forward + backward (gradient reduction skipped on the first K-1 under `spmd.no_sync`; under `--zero 1` on
all K, then `spmd.reduce_gradients` reduce-scatters them into the optimizer's shards); clip by the global
gradient norm (over every mesh axis); AdamW step. Then metrics, and a checkpoint when due.

Layout: the model is built on the meta device and laid out with `spmd.parallelize` (`spmd.build_pipeline`
with a pp axis), each rank initialising only its shards to the values a one-device build has;
a single process without torchrun trains plain PyTorch (no process group, no DTensors). Checkpoints from
either load into the other.

Precision: `bf16`/`fp16` keep fp32 master parameters and fp32 AdamW states; parameters are cast when
gathered (`parallelize(param_dtype=...)`; autocast in a single process) and gradients are reduced in fp32.
`--master optimizer` stores the parameters in the compute dtype and the fp32 master beside the AdamW states.

ZeRO: `--zero 1|2|3` picks the rules' maps (`spmd.Rules.default(zero=k)`); `spmd.shard_optimizer` makes the
optimizer update the optimizer map's shards and all-gather the updated parameters after the step;
`--offload optimizer|nvme:DIR` keeps its masters and states in host memory or in files, the step on the CPU.
`fp16` adds dynamic loss scaling: a step whose gradient norm is inf/nan is skipped and the scale halves;
after 1000 good steps it doubles.

Failures (docs/checkpoints-and-failures.md): ranks first agree on config and code (`launch.startup`), every
collective is bounded by --collective-timeout, a step with a non-finite loss or gradient norm is skipped
and --max-bad-steps of them in a row stop the run (`launch.nonfinite`), and --resume starts from the newest
checkpoint whose checksums verify.

`--compile`: each block runs as one compiled graph with its collectives inside (`spmd.compile_blocks`); a
block under activation checkpointing compiles its body. `--kernels triton` selects the fused Triton kernels.

Checkpoints (`--ckpt-async`, the default): the loop waits only while the state is copied to host memory; a
thread writes, hashes and commits it (spmd.checkpoint.AsyncSaver). The next save and the end of training wait
for it; its failure stops every rank at the next step.

SIGTERM/SIGINT: the step in flight finishes, a checkpoint is written (with --ckpt-dir) and the process
exits 0. A second signal interrupts at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import models
import spmd
from spmd import checkpoint
from spmd.analysis.record import CollectiveRecorder
from spmd.float8 import float8_layers
from spmd.layout.dtypes import DTYPES
from spmd.runtime.optimizer.shard import refresh_masters

from . import schedule, startup
from .config import TrainConfig, load_config
from .data import model_inputs
from .metrics import MetricsLogger, flops_per_token, peak_flops, peak_mem_bytes
from .nonfinite import BadSteps, Diverged, LossScaler
from .profile import StepProfiler
from .setup import build_model, optimizer, ranks, resume_point
from .stopping import StopRequest, stop_everywhere
from .validate import Validator, build_loaders


# --------------------------------------------------------------------------------------------- pieces
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


# --------------------------------------------------------------------------------------------- loop
def train(cfg: TrainConfig, log=True) -> list[dict]:
    """Runs the training loop described in the module docstring; returns rank's metric rows."""
    rank, world, local_rank = ranks()
    if cfg.init_from_hf and not cfg.model.startswith("hf:"):
        from .hf import config_from_hf

        model_cfg = config_from_hf(cfg.init_from_hf)
        model_cfg.kernels = cfg.kernels
    else:
        model_cfg = cfg.model_config()
    cfg.validate(world, model_cfg)  # on every rank, before any collective
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    code, agreed = startup.code_version(), None
    if world > 1:
        startup.start_process_group(cfg.collective_timeout, device)
        agreed = startup.agree(cfg, model_cfg)  # the first collective: same config and code on every rank
    model, mesh, dp_rank, dp_size, pipe = build_model(cfg, model_cfg, world, device)
    # a group torchrun restarted resumes even without --resume: starting over would overwrite the checkpoints
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and bool(cfg.ckpt_dir)
    resume_from = resume_point(cfg, rank) if cfg.resume or restarted else None
    resuming = resume_from is not None
    if cfg.init_from_hf and not resuming:  # a checkpoint, when there is one, overrides the HF weights
        from .hf import load_hf

        load_hf(model, cfg.init_from_hf, **({"strict": False} if pipe else {}))
    # a pipeline checkpoints inside its stages (build_pipeline's ac)
    ac_blocks = [] if pipe else spmd.apply_activation_checkpointing(model, cfg.ac)
    compiled = spmd.compile_blocks(model) if cfg.compile else []
    opt = optimizer(model, cfg)
    if mesh is not None:  # --zero 1/2: the optimizer updates the optimizer map's shards
        spmd.shard_optimizer(model if pipe is None else pipe, opt)
    scaler = LossScaler(cfg.dtype == "fp16")
    bad = BadSteps(cfg.max_bad_steps, loss_scaling=scaler.enabled)
    loader, tokenizer, val_set = build_loaders(cfg, dp_rank, dp_size, model_cfg.vocab_size, device)

    start = 0
    if resuming:
        # under pp this rank holds only its stages' tensors of the global checkpoint
        meta = checkpoint.load(
            resume_from,
            checkpoint.model_state(model),
            checkpoint.optim_state(model, opt, init=True),
            rng=True,
            strict=pipe is None,
        )
        start = int(meta["step"])
        refresh_masters(opt)
        loader.load_state_dict(meta["data"])
        scaler.load_state_dict(meta.get("loss_scale"))
        bad.last_good = start
        bad.load_state_dict(meta.get("bad_steps"))

    single_autocast = world == 1 and cfg.dtype != "fp32"
    fpt = flops_per_token(model_cfg, cfg.seq_len)
    peak, peak_source = peak_flops(cfg.dtype, device) if rank == 0 else (0.0, "")
    metrics = MetricsLogger(
        cfg.steps,
        cfg.batch_size * cfg.seq_len,
        fpt,
        peak,
        world,
        cfg.metrics,
        cfg.tensorboard,
        cfg.log_every,
        enabled=rank == 0,
        start_step=start,
        console=log,
        wandb=cfg.wandb,
        run_config=cfg.to_dict(),
    )
    if rank == 0:
        n = model_cfg.num_params()
        float8 = f" with {len(float8_layers(model))} linear layers in float8" if cfg.float8 else ""
        metrics.write(
            f"[launch.train] model {cfg.model if not cfg.init_from_hf else cfg.init_from_hf}: "
            f"{n / 1e6:.2f}M params, {fpt / 1e6:.2f} MFLOP/token | "
            f"mesh {cfg.mesh_sizes(world)}{' +sp' if cfg.sequence_parallel() else ''} on {world} "
            f"{device.type} process(es) | batch {cfg.batch_size}x{cfg.seq_len} in {cfg.grad_accum} "
            f"micro-batch(es) | {cfg.dtype}{float8} | ac {cfg.ac}{ac_blocks if ac_blocks else ''} | "
            f"compiled blocks {compiled if cfg.compile else 'none'} | kernels {model_cfg.kernels} | "
            f"data {cfg.data} ({len(loader.tokens):,} tokens, {cfg.tokenizer}) | "
            f"peak {peak / 1e12:.3g} TFLOP/s per device ({peak_source}) | code {code}"
            f"{f' | config {agreed} on every rank' if agreed else ''}"
        )
        if start:
            metrics.write(
                f"[launch.train] resumed from {resume_from} at step {start}"
                + (f" (torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']})" if restarted else "")
            )

    validator = Validator(cfg, val_set, model, mesh, pipe, world, say=metrics.write)  # says what it evaluates
    comm = 0
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
    stop = StopRequest()
    stop.install()
    profiler = StepProfiler(cfg.profile_steps, cfg.profile_dir, rank, device)
    rows: list[dict] = []
    step = start
    saver = checkpoint.AsyncSaver() if cfg.ckpt_dir and cfg.ckpt_async else None
    try:
        while step < cfg.steps:
            profiler.before(step + 1)
            lr = schedule.lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
            schedule.set_lr(opt, lr)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            micro = loader.next()
            # the first and the last step are recorded (a dispatch mode: 20-30% of a tiny model's CPU step);
            # the steps between issue the same collectives, layouts and shapes being fixed, and the last
            # step's own measurement is there to show it
            recorded = mesh is not None and (step == start or step + 1 == cfg.steps)
            recorder = CollectiveRecorder(mesh) if recorded else None
            with recorder if recorder is not None else contextlib.nullcontext():
                loss_sum = torch.zeros((), device=device)
                for j, (x, y) in enumerate(micro):
                    last = j == len(micro) - 1
                    if pipe is not None:  # forward and backward of every pipeline micro-batch
                        x, y, *positions = model_inputs(x, y, mesh)
                        loss_sum += pipe.step(
                            x,
                            y,
                            loss_scale=scaler.scale / len(micro),
                            sync=last,
                            positions=positions[0] if positions else None,
                        ).float() / len(micro)
                        continue
                    sync = contextlib.nullcontext() if (last or mesh is None) else spmd.no_sync(model)
                    amp = (
                        torch.autocast(device.type, dtype=DTYPES[cfg.dtype])
                        if single_autocast
                        else contextlib.nullcontext()
                    )
                    with sync:  # no_sync covers the backward: that is where gradients are reduced
                        with amp:
                            loss = model(*model_inputs(x, y, mesh)) / len(micro)
                        (loss * scaler.scale).backward()
                    loss_sum += loss.detach().float()
                if mesh is not None:  # --zero 1: the gradients backward held, reduced before clipping
                    spmd.reduce_gradients(model if pipe is None else pipe)
                if scaler.enabled:
                    for p in params:
                        if p.grad is not None:
                            p.grad.div_(scaler.scale)
                if pipe is not None:  # the norm over every stage, not only this rank's
                    grad_norm = _full(pipe.clip_grad_norm_(max_norm))
                elif isinstance(opt, spmd.OneBitAdam):  # after warm-up: the local gradients, never reduced
                    grad_norm = _full(opt.clip_grad_norm_(max_norm))
                else:
                    grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None))
                loss_value = float(loss_sum)  # synchronises with the device
                good = bad.check(step + 1, loss_value, float(grad_norm))
                if good:
                    opt.step()
                scaler.update(good)
                opt.zero_grad(set_to_none=True)
            step_time = time.perf_counter() - t0
            if recorder is not None:
                comm = sum(r.bytes for r in recorder.records)
            step += 1
            extra = {**_router_metrics(model), **validator.metrics(step)}  # in this order: eval replaces the first
            rows.append(
                metrics.record(
                    step,
                    loss_value,
                    float(grad_norm),
                    lr,
                    step_time,
                    peak_mem_bytes(device),
                    comm,
                    skipped_steps=bad.skipped,
                    extra=extra,
                )
            )
            for path in profiler.after(step):
                metrics.write(f"[launch.train] profile: {path}" + (" (one per rank)" if world > 1 else ""))
            # one all-reduce: a stop asked on any rank, a background save failed on any rank
            stopping, save_failed = stop_everywhere(stop.requested, device, saver is not None and saver.failed())
            if save_failed:
                saver.wait()  # raises the writer's error, on every rank at this same step
            diverged = bad.exhausted
            due = cfg.ckpt_dir and (
                step == cfg.steps or stopping or diverged or (cfg.ckpt_every and step % cfg.ckpt_every == 0)
            )
            path = None
            if due:
                path = (saver.save if saver else checkpoint.save)(
                    cfg.ckpt_dir,
                    step,
                    checkpoint.model_state(model),
                    checkpoint.optim_state(model, opt),
                    meta={
                        "config": cfg.to_dict(),
                        "model_config": model_cfg.to_dict(),
                        "model": models.entry(model_cfg).name,
                        "data": loader.state_dict(),
                        "loss_scale": scaler.state_dict(),
                        "bad_steps": bad.state_dict(),
                        "mesh": cfg.mesh_sizes(world),
                        "code_version": code,
                    },
                    keep=cfg.ckpt_keep or None,
                )
                metrics.write(
                    f"[launch.train] step {step}: checkpoint {path}" + (" (writing in the background)" if saver else "")
                )
            if diverged:
                if saver:
                    saver.wait()  # the message names the checkpoint: it must be there
                raise Diverged(bad.message(step, str(path) if path else None))
            if stopping:
                metrics.write(
                    f"[launch.train] stopped by signal after step {step}"
                    + ("" if cfg.ckpt_dir else " (no --ckpt-dir: nothing saved)")
                )
                break
        if saver:
            saver.close()  # the end of training waits for the last checkpoint (and raises its error)
    finally:
        profiler.close()
        stop.uninstall()
        metrics.close()
    return rows


EXIT_BAD_INPUT, EXIT_RANK_LOST, EXIT_DIVERGED = 2, 3, 4


def _rank_lost(e: BaseException) -> bool:
    """A collective failed because another rank is gone or stuck (closed connection or timeout)."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(
        s in text
        for s in (
            "connection closed by peer",
            "connection reset",
            "timed out",
            "timeout",
            "broken pipe",
            "gloo",
            "nccl",
        )
    )


def main(argv: list[str] | None = None) -> int:
    # clip_grad_norm_ over a 2-D mesh reduces the norm axis by axis; DTensor warns about it on every rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank, world, _ = ranks()
    prefix = f"launch.train{f' [rank {rank}]' if world > 1 else ''}: error:"
    try:
        cfg = load_config(argv)
    except ValueError as e:  # a bad TOML file or rules table: every rank, before any collective
        print(f"{prefix} {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        train(cfg)
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:  # bad input: the message says the fix
        print(f"{prefix} {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Diverged as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except Exception as e:
        if world == 1 or not _rank_lost(e):
            raise
        print(
            f"{prefix} a collective failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}): another "
            f"rank died, was killed or stopped responding (collectives wait at most --collective-timeout "
            f"{cfg.collective_timeout:g} s), so this rank stops too. The rank that failed first says why in "
            f"its own output; with --ckpt-dir, --resume continues from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_RANK_LOST)  # not destroy_process_group: tearing down a group with a lost peer can block
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmd.layout.mesh import exit_process

    exit_process(main())  # not sys.exit: see exit_process
