"""Per-step metrics: FLOPs per token, MFU, a rank-0 progress bar, a JSONL file, optional tensorboard and W&B.

FLOPs per token are the model's own count (its config's `flops_per_token`; for Llama 6 * N_non_embedding +
12 * L * H * Q * T). MFU = tokens/s * FLOPs per token / (peak * devices).

Peak FLOP/s per device: spmd's device table of dense tensor-core peaks for known GPUs (H100/H200 SXM bf16
989e12, A100 312e12, ...; fp32 uses the TF32 figure when `torch.backends.cuda.matmul.allow_tf32` is on, else
the plain fp32 one). Anywhere else (CPU, unknown GPUs) the peak is the best GEMM FLOP/s measured on this
machine at this dtype and thread count, measured once and cached in `<cache>/peak_flops.json`
($SPMD_CACHE_DIR or ~/.cache/spmd). On CPU a "device" is one process with its torch thread count.

JSONL lines carry exactly: step, loss, grad_norm, lr, tokens_per_s, mfu, step_time_s, peak_mem_bytes,
comm_bytes, skipped_steps, and after a validation (`--val-every`) val_loss and val_perplexity, written even
where --log-every would skip the row (TensorBoard and W&B log them as `val_loss` and `val_perplexity`, the
rest as `train/KEY`). `step` counts completed optimizer steps (1 is the first); `comm_bytes` is bytes on
the wire per rank for a step (spmd.analysis.record's ring convention), measured on the run's first and last
steps only (recording slows a small CPU step by a fifth or more); the rows between carry the first step's
figure; `peak_mem_bytes` is the CUDA allocator's peak during the step, or the process's peak resident memory
on CPU; `skipped_steps` counts the steps so far whose update was skipped for a non-finite loss or gradient
norm. A resumed run first drops the lines after the step it resumes from (written after that checkpoint by
the run that stopped), so the file holds each step once.

`--wandb PROJECT` logs the same rows to Weights & Biases, offline unless WANDB_MODE says otherwise (training
machines often have no network): the run lands in `./wandb/offline-run-*` (or under $WANDB_DIR), and
`wandb sync` uploads it later; WANDB_MODE=online streams it live.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import resource
import sys
from pathlib import Path

import torch

from spmd.analysis.devices import gpu_peaks, measure_gemm_flops
from spmd.layout.dtypes import DTYPES

KEYS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "peak_mem_bytes",
    "comm_bytes",
    "skipped_steps",
)


VAL_KEYS = ("val_loss", "val_perplexity")  # added to the rows of the steps validation ran after (launch.validate)


def _tag(key: str) -> str:
    """TensorBoard's tag and W&B's key of a row's field: train/KEY, validation's under their own names."""
    return key if key in VAL_KEYS else f"train/{key}"


def flops_per_token(model_cfg, seq_len: int) -> int:
    return model_cfg.flops_per_token(seq_len)


def _cache_file() -> Path:
    return Path(os.environ.get("SPMD_CACHE_DIR") or Path.home() / ".cache" / "spmd") / "peak_flops.json"


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_flops(dtype: str = "fp32", device: str | torch.device = "cpu") -> tuple[float, str]:
    """(peak FLOP/s per device, where the number came from)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {tuple(DTYPES)}")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = "tf32" if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32 else dtype
        known = gpu_peaks(name)
        if known is not None:
            return known[1][key], f"table: {known[0]} {key}"
    else:
        name = f"{cpu_name()} x{torch.get_num_threads()} threads"
    key = f"{name}|{dtype}|torch {torch.__version__.split('+')[0]}"
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures while the others wait
        cache = json.loads(path.read_text()) if path.is_file() else {}
        if key not in cache:
            cache[key] = measure_gemm_flops(DTYPES[dtype], str(device))
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)
    return float(cache[key]), f"measured GEMM ({key}), cached in {path}"


def peak_mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def wandb_run(project: str, config: dict | None = None):
    """A W&B run of `project`, offline unless WANDB_MODE is set (module docstring)."""
    try:
        import wandb
    except ImportError:
        raise ImportError("--wandb needs the wandb package: pip install 'spmd[wandb]' (or drop --wandb)") from None
    os.environ.setdefault("WANDB_MODE", "offline")
    return wandb.init(project=project, config=config)


class MetricsLogger:
    """Rank 0 (`enabled`) writes JSONL/tensorboard/W&B and, with `console`, shows a tqdm bar and messages;
    other ranks only compute the row."""

    def __init__(
        self,
        total_steps: int,
        tokens_per_step: int,
        flops_per_token: int,
        peak: float,
        n_devices: int,
        jsonl: str = "",
        tensorboard: str = "",
        log_every: int = 1,
        enabled: bool = True,
        start_step: int = 0,
        console: bool = True,
        wandb: str = "",
        run_config: dict | None = None,
    ):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.n_devices, self.log_every, self.enabled = peak, n_devices, log_every, enabled
        self.jsonl = self.tb = self.bar = self.wandb = None
        self.first_loss = self.last_loss = None
        self.steps_done = 0
        if not enabled:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "--tensorboard needs the tensorboard package: pip install tensorboard (or drop --tensorboard)"
                ) from None
            self.tb = SummaryWriter(tensorboard)
        if wandb:
            self.wandb = wandb_run(wandb, run_config)
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{jsonl}.tmp")
            tmp.write_text("".join(_lines_up_to(Path(jsonl), start_step) if start_step else []))
            os.replace(tmp, jsonl)
            self.jsonl = open(jsonl, "a")
        if not console:
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5 if sys.stdout.isatty() else 10.0,
            file=sys.stdout,
        )

    def record(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        step_time_s: float,
        peak_mem_bytes: int,
        comm_bytes: int,
        skipped_steps: int = 0,
        extra: dict | None = None,
    ) -> dict:
        tokens_per_s = self.tokens_per_step / step_time_s if step_time_s > 0 else 0.0
        mfu = tokens_per_s * self.flops_per_token / (self.peak * self.n_devices) if self.peak else 0.0
        row = dict(
            step=step,
            loss=float(loss),
            grad_norm=float(grad_norm),
            lr=float(lr),
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            step_time_s=step_time_s,
            peak_mem_bytes=int(peak_mem_bytes),
            comm_bytes=int(comm_bytes),
            skipped_steps=int(skipped_steps),
            **(extra or {}),
        )  # the model's own figures, e.g. a mixture of experts' router load
        if not self.enabled:
            return row
        if self.first_loss is None:
            self.first_loss = row["loss"]
        self.last_loss, self.steps_done = row["loss"], self.steps_done + 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"loss {row['loss']:.4f}  {tokens_per_s:,.0f} tok/s  MFU {100 * mfu:.1f}%", refresh=False
            )
        if step % self.log_every == 0 or VAL_KEYS[0] in row:  # a validation's row is always kept
            if self.jsonl:
                self.jsonl.write(json.dumps(row) + "\n")
                self.jsonl.flush()
            if self.tb:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self.tb.add_scalar(_tag(k), v, step)
            if self.wandb:
                self.wandb.log({_tag(k): v for k, v in row.items() if k != "step"}, step=step)
        return row

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)

    def close(self) -> None:
        for thing in (self.bar, self.jsonl, self.tb):
            if thing is not None:
                thing.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None and self.steps_done:
            print(self.summary(), flush=True)

    def summary(self) -> str:
        """One line with the loss at the first and the last step this run trained (CI reads it)."""
        return f"[launch.train] done: {self.steps_done} steps, loss {self.first_loss:.4f} -> {self.last_loss:.4f}"


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The JSONL lines of steps <= `step` (an unreadable line ends the kept part: a killed writer's last)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] > step:
                break
        except (ValueError, KeyError):
            break
        kept.append(line if line.endswith("\n") else line + "\n")
    return kept
