"""Every check of a training config, run on every rank before any collective: each problem is a line naming
it and its fix, and `TrainConfig.validate` raises them all at once.

    problems = config_problems(cfg, world_size, model_cfg)   # [] when the config can run
"""

from __future__ import annotations

from kernels import IMPLS
from spmd.layout.dtypes import DTYPES
from spmd.layout.mesh import format_sizes
from spmd.layout.rules import ZERO_STAGES
from spmd.runtime.state import MASTERS
from spmd.runtime.transforms.checkpointing import parse_mode as parse_ac_mode
from spmd.runtime.wire.setting import GRAD_FORMATS, PARAM_FORMATS

from .mesh_checks import mesh_problems, model_problems
from .profile import parse_steps as parse_profile_steps

__all__ = ["config_problems", "flag_name"]


def flag_name(name: str) -> str:
    """The command-line flag of a config field, without its dashes: batch_size -> batch-size."""
    return name.replace("_", "-")


def config_problems(cfg, world_size: int = 1, model_cfg=None) -> list[str]:
    """The problems of `cfg` on `world_size` processes (model_cfg: the resolved model config, if known)."""
    problems = _scalar_problems(cfg) + _zero_problems(cfg) + _run_problems(cfg) + _validation_problems(cfg)
    sizes, flags = cfg.parse_mesh()
    sizes = sizes or {"fsdp": world_size}
    problems += mesh_problems(cfg, world_size, sizes, flags) + _optimizer_problems(cfg, sizes)
    problems += _comm_problems(cfg, sizes)
    if model_cfg is None and (not cfg.init_from_hf or cfg.model.startswith("hf:")):
        try:
            model_cfg = cfg.model_config()
        except ValueError as e:
            problems.append(f"--model: {e}")
    return problems + model_problems(cfg, world_size, sizes, model_cfg)


def _scalar_problems(cfg) -> list[str]:
    problems = [
        f"--{flag_name(n)} must be >= 1, got {getattr(cfg, n)}"
        for n in ("steps", "batch_size", "seq_len", "grad_accum", "log_every")
        if getattr(cfg, n) < 1
    ]
    problems += [
        f"--{flag_name(n)} must be >= 0, got {getattr(cfg, n)}"
        for n in ("warmup", "ckpt_every", "ckpt_keep", "max_grad_norm", "weight_decay", "seed", "max_bad_steps")
        if getattr(cfg, n) < 0
    ]
    if not cfg.lr > 0:
        problems.append(f"--lr must be positive, got {cfg.lr}")
    if not cfg.collective_timeout > 0:
        problems.append(f"--collective-timeout must be a positive number of seconds, got {cfg.collective_timeout}")
    if cfg.dtype not in DTYPES:
        problems.append(f"--dtype {cfg.dtype!r} is not one of {'|'.join(DTYPES)}; pick one of them")
    return problems


def _optimizer_problems(cfg, sizes) -> list[str]:
    """--optimizer, --muon-lr and --onebit-warmup."""
    if cfg.optimizer not in ("adamw", "muon", "onebit-adam"):
        return [f"--optimizer {cfg.optimizer!r} is not supported; use adamw, muon or onebit-adam"]
    if cfg.optimizer == "onebit-adam":
        return _onebit_problems(cfg, sizes)
    if cfg.optimizer != "muon":
        return []
    problems = [] if cfg.muon_lr > 0 else [f"--muon-lr must be positive, got {cfg.muon_lr}"]
    if sizes.get("pp", 1) > 1:
        problems.append(
            "--optimizer muon exchanges whole matrices over the whole mesh, which a pipeline's stages "
            "do not share: use a mesh without pp, or --optimizer adamw"
        )
    if cfg.offload:
        problems.append(
            f"--optimizer muon steps on the device; --offload {cfg.offload} moves the step to the host: "
            f"leave --offload out, or use --optimizer adamw"
        )
    return problems


def _onebit_problems(cfg, sizes) -> list[str]:
    """What spmd.OneBitAdam cannot run on: it compresses across data-parallel workers (dp, fsdp) only."""
    problems = [] if cfg.onebit_warmup >= 1 else [f"--onebit-warmup must be >= 1, got {cfg.onebit_warmup}"]
    other = [f"{a}={n}" for a, n in sizes.items() if n > 1 and a not in ("dp", "fsdp")]
    if other:
        problems.append(
            f"--optimizer onebit-adam compresses the momentum across data-parallel workers (dp, fsdp); "
            f"--mesh has {', '.join(other)}: use a mesh of dp and fsdp only, or --optimizer adamw"
        )
    if cfg.zero != 3 or cfg.rules_table:
        problems.append(
            "--optimizer onebit-adam keeps its state in the parameters' storage layout: use --zero 3 and "
            "no [rules] table (the default rules)"
        )
    if cfg.offload or cfg.master != "params":
        problems.append(
            "--optimizer onebit-adam steps on the device on the parameters themselves: leave --offload "
            "out and keep --master params"
        )
    return problems


def _zero_problems(cfg) -> list[str]:
    """--zero, --master and --offload problems (names and fixes)."""
    problems = []
    if cfg.zero not in ZERO_STAGES:
        problems.append(
            f"--zero {cfg.zero} is not a ZeRO stage; use 1 (optimizer states sharded over fsdp), 2 "
            f"(+ gradients), 3 (+ parameters: FSDP, the default), or 0 (none)"
        )
    if cfg.master not in MASTERS:
        problems.append(
            f"--master {cfg.master!r} is not one of {'|'.join(MASTERS)}: 'params' keeps fp32 parameters, "
            f"'optimizer' keeps --dtype parameters and the fp32 master with the optimizer states"
        )
    if cfg.offload == "params" and cfg.zero != 3:
        problems.append(
            f"--offload params keeps stage-3 parameter shards on the host; --zero {cfg.zero} keeps "
            f"parameters whole on the device: use --zero 3, or --offload optimizer"
        )
    if cfg.offload == "params" and cfg.compile:
        problems.append(
            "--offload params with --compile is not supported (compiled blocks gather parameters "
            "where they are stored); leave --compile out, or use --offload optimizer"
        )
    elif cfg.offload not in ("", "optimizer", "params") and not (
        cfg.offload.startswith("nvme:") and len(cfg.offload) > 5
    ):
        problems.append(
            f"--offload {cfg.offload!r} is not supported; use --offload optimizer (AdamW states and "
            f"fp32 masters in host memory, the step on the CPU), --offload params (stage-3 parameter "
            f"shards too), --offload nvme:DIR (states in files under DIR) or leave it out"
        )
    return problems


def _comm_problems(cfg, sizes: dict) -> list[str]:
    """--comm-params, --comm-grads and --hpz (spmd.parallelize's `comm`)."""
    problems = []
    if cfg.comm_params not in ("", *filter(None, PARAM_FORMATS)):
        problems.append(f"--comm-params {cfg.comm_params!r} is not supported; use int8, fp8 or float8, or leave it out")
    if cfg.comm_params == "float8" and not cfg.float8:
        problems.append(
            "--comm-params float8 gathers float8 layers' weights in float8 and needs --float8; add --float8, "
            "or use --comm-params fp8 (block-wise scales, any parameter)"
        )
    if cfg.comm_grads not in ("", *filter(None, GRAD_FORMATS)):
        problems.append(f"--comm-grads {cfg.comm_grads!r} is not supported; use int8 or int4, or leave it out")
    if cfg.hpz and sizes.get(cfg.hpz, 1) == 1:
        problems.append(
            f"--hpz {cfg.hpz!r} is not an axis of --mesh {format_sizes(sizes)} with more than one rank; name "
            f"the axis inside a node that keeps backward's secondary parameter shards (e.g. fsdp), or leave it out"
        )
    in_graph = [f"--mesh axis {a}" for a, n in sizes.items() if n > 1 and a not in ("dp", "fsdp", "pp", "tp")]
    in_graph += ["--float8 over tp"] if cfg.float8 and sizes.get("tp", 1) > 1 else []
    if cfg.comm() and cfg.compile and in_graph:
        problems.append(
            f"--comm-params/--comm-grads/--hpz with --compile and {', '.join(in_graph)} is not supported: those "
            "blocks move tensors inside their compiled graph, which has no quantized wire (compiled blocks carry "
            "comm on dp/fsdp/tp meshes, with or without --sp and --ac, and --float8 without tp); leave --compile "
            "or those options out"
        )
    return problems


def _run_problems(cfg) -> list[str]:
    """Activation checkpointing, kernels, checkpoints and profiling."""
    problems = []
    try:
        parse_ac_mode(cfg.ac)
    except ValueError:
        problems.append(
            f"--ac {cfg.ac!r} is not valid; use none, full, or selective:N with N >= 1 (checkpoint every N-th block)"
        )
    if cfg.kernels not in IMPLS:
        problems.append(
            f"--kernels {cfg.kernels!r} is not one of {'|'.join(IMPLS)}; pick one "
            f"(triton on CPU needs TRITON_INTERPRET=1)"
        )
    if cfg.resume and not cfg.ckpt_dir:
        problems.append("--resume needs --ckpt-dir DIR to resume from")
    if cfg.ckpt_every and not cfg.ckpt_dir:
        problems.append("--ckpt-every needs --ckpt-dir DIR to write to")
    try:
        profiled = parse_profile_steps(cfg.profile_steps)
        if profiled and profiled[1] > cfg.steps:
            problems.append(
                f"--profile-steps {cfg.profile_steps} ends after the last step ({cfg.steps}); end at "
                f"step {cfg.steps} or before"
            )
    except ValueError as e:
        problems.append(str(e))
    return problems


def _validation_problems(cfg) -> list[str]:
    """--val-every, --val-batches and --val-data (launch/validate.py)."""
    problems = []
    if cfg.val_every < 0:
        problems.append(
            f"--val-every must be >= 0 (steps between validations; 0 turns validation off), got {cfg.val_every}"
        )
    if cfg.val_batches < 1:
        problems.append(f"--val-batches must be >= 1 (batches each validation evaluates), got {cfg.val_batches}")
    if cfg.val_data and not cfg.val_every:
        problems.append(
            f"--val-data {cfg.val_data} is never read without --val-every N; add --val-every N "
            f"(e.g. --val-every {max(1, cfg.steps // 10)}) or drop --val-data"
        )
    return problems
