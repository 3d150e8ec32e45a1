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

import logging
import os
import sys

import torch
import torch.distributed as dist

import spmd
from spmd import checkpoint
from spmd.float8 import float8_layers
from spmd.runtime.optimizer.shard import refresh_masters

from . import startup
from .config import TrainConfig, load_config
from .metrics import MetricsLogger, flops_per_token, peak_flops
from .nonfinite import BadSteps, Diverged, LossScaler
from .profile import StepProfiler
from .setup import build_model, optimizer, ranks, resume_point
from .step import Run, end_of_step, train_step
from .stopping import StopRequest
from .validate import Validator, build_loaders


def train(cfg: TrainConfig, log=True) -> list[dict]:
    """Runs the training loop described in the module docstring; returns rank's metric rows."""
    run = _set_up(cfg, log)
    rows, step = [], run.start
    try:
        while step < cfg.steps:
            rows.append(train_step(run, step))
            step += 1
            if end_of_step(run, step):
                break
        if run.saver:
            run.saver.close()  # the end of training waits for the last checkpoint (and raises its error)
    finally:
        run.close()
    return rows


def _set_up(cfg: TrainConfig, log: bool) -> Run:
    """The process group, the model laid out, its optimizer and data, the checkpoint resumed, the loggers."""
    rank, world, local_rank = ranks()
    model_cfg = _model_config(cfg)
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
    if cfg.init_from_hf and resume_from is None:  # a checkpoint, when there is one, overrides the HF weights
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
    loader, _, val_set = build_loaders(cfg, dp_rank, dp_size, model_cfg.vocab_size, device)
    run = Run(cfg, model_cfg, model, opt, mesh, pipe, device, world, code, loader, scaler, bad)
    if resume_from is not None:
        _resume(run, resume_from)
    run.metrics, peak_source = _metrics_logger(run, rank, log)
    if rank == 0:
        _announce(run, f"{agreed} on every rank" if agreed else "", ac_blocks, compiled, peak_source)
        if run.start:
            run.metrics.write(
                f"[launch.train] resumed from {resume_from} at step {run.start}"
                + (f" (torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']})" if restarted else "")
            )
    run.validator = Validator(cfg, val_set, model, mesh, pipe, world, say=run.metrics.write)  # says what it does
    run.params = [p for p in model.parameters() if p.requires_grad]
    run.stop = StopRequest()
    run.stop.install()
    run.profiler = StepProfiler(cfg.profile_steps, cfg.profile_dir, rank, device)
    run.saver = checkpoint.AsyncSaver() if cfg.ckpt_dir and cfg.ckpt_async else None
    return run


def _model_config(cfg: TrainConfig):
    if cfg.init_from_hf and not cfg.model.startswith("hf:"):
        from .hf import config_from_hf

        model_cfg = config_from_hf(cfg.init_from_hf)
        model_cfg.kernels = cfg.kernels
        return model_cfg
    return cfg.model_config()


def _resume(run: Run, resume_from) -> None:
    """The model, optimizer, data position, loss scale and bad-step count of the checkpoint `resume_from`."""
    # under pp this rank holds only its stages' tensors of the global checkpoint
    meta = checkpoint.load(
        resume_from,
        checkpoint.model_state(run.model),
        checkpoint.optim_state(run.model, run.opt, init=True),
        rng=True,
        strict=run.pipe is None,
    )
    run.start = int(meta["step"])
    refresh_masters(run.opt)
    run.loader.load_state_dict(meta["data"])
    run.scaler.load_state_dict(meta.get("loss_scale"))
    run.bad.last_good = run.start
    run.bad.load_state_dict(meta.get("bad_steps"))


def _metrics_logger(run: Run, rank: int, log: bool) -> tuple[MetricsLogger, str]:
    """(the logger, where rank 0's peak FLOP/s figure comes from)."""
    cfg = run.cfg
    peak, peak_source = peak_flops(cfg.dtype, run.device) if rank == 0 else (0.0, "")
    tokens, fpt = cfg.batch_size * cfg.seq_len, flops_per_token(run.model_cfg, cfg.seq_len)
    logger = MetricsLogger(
        cfg.steps,
        tokens,
        fpt,
        peak,
        run.world,
        cfg.metrics,
        cfg.tensorboard,
        cfg.log_every,
        enabled=rank == 0,
        start_step=run.start,
        console=log,
        wandb=cfg.wandb,
        run_config=cfg.to_dict(),
    )
    return logger, peak_source


def _announce(run: Run, agreed: str, ac_blocks, compiled, peak_source: str) -> None:
    """Rank 0's first line: the model, mesh, batch, precision, transforms, data, peak and code."""
    cfg, model_cfg, world, device = run.cfg, run.model_cfg, run.world, run.device
    n, fpt, peak = model_cfg.num_params(), run.metrics.flops_per_token, run.metrics.peak
    float8 = f" with {len(float8_layers(run.model))} linear layers in float8" if cfg.float8 else ""
    run.metrics.write(
        f"[launch.train] model {cfg.model if not cfg.init_from_hf else cfg.init_from_hf}: "
        f"{n / 1e6:.2f}M params, {fpt / 1e6:.2f} MFLOP/token | "
        f"mesh {cfg.mesh_sizes(world)}{' +sp' if cfg.sequence_parallel() else ''} on {world} "
        f"{device.type} process(es) | batch {cfg.batch_size}x{cfg.seq_len} in {cfg.grad_accum} "
        f"micro-batch(es) | {cfg.dtype}{float8} | ac {cfg.ac}{ac_blocks if ac_blocks else ''} | "
        f"compiled blocks {compiled if cfg.compile else 'none'} | kernels {model_cfg.kernels} | "
        f"data {cfg.data} ({len(run.loader.tokens):,} tokens, {cfg.tokenizer}) | "
        f"peak {peak / 1e12:.3g} TFLOP/s per device ({peak_source}) | code {run.code}"
        f"{f' | config {agreed}' if agreed else ''}"
    )


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
