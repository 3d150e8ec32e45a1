"""The checks of a training config that concern the mesh and the model (launch.config_checks runs them with the
rest): the mesh against the process count, the batch and the sequence; the model against the mesh; float8; the
pipeline's settings. Each problem is a line naming it and its fix."""

from __future__ import annotations

from spmd.float8 import INSTALL_HINT as FLOAT8_INSTALL
from spmd.layout.mesh import format_sizes
from spmd.layout.sequence import check_seq_len
from spmd.pipeline.runtime import validate_pipeline

__all__ = ["mesh_problems", "model_problems"]


def mesh_problems(cfg, world_size: int, sizes: dict, flags) -> list[str]:
    """The mesh against the process count, the batch, and the sequence (sequence and context parallelism)."""
    problems = []
    product = 1
    for s in sizes.values():
        product *= s
    if product != world_size:
        problems.append(
            f"--mesh {format_sizes(sizes)} has {product} devices but {world_size} processes were "
            f"started; make the product of the axis sizes equal the process count (e.g. "
            f"--nproc-per-node {product})"
        )
    try:
        rules = cfg.rules()
    except ValueError as e:
        return problems + [str(e)]
    dp = rules.data_parallel_size(sizes)
    if cfg.batch_size % (dp * cfg.grad_accum):
        step = dp * cfg.grad_accum
        problems.append(
            f"--batch-size {cfg.batch_size} must divide by the data-parallel size "
            f"({'*'.join(rules.batch_axes())} = {dp}) times --grad-accum {cfg.grad_accum} = {step}; use "
            f"a batch size that is a multiple of {step}, e.g. {max(1, round(cfg.batch_size / step)) * step}"
        )
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    sp = cfg.sp or "sp" in flags
    if sp and tp > 1 and cfg.seq_len % tp:
        problems.append(
            f"--seq-len {cfg.seq_len} must divide by tp={tp} with sequence parallelism; pick a multiple of {tp}"
        )
    if cp > 1:
        try:
            check_seq_len(cfg.seq_len, cp)
        except ValueError as e:
            problems.append(f"--seq-len: {e}")
        if sp and cfg.seq_len % (cp * tp):
            problems.append(f"--seq-len {cfg.seq_len} must divide by cp*tp={cp * tp} with sequence parallelism")
        if cfg.compile:
            problems.append(
                "--compile with cp is not supported yet (ring attention exchanges K/V blocks point to "
                "point, outside the compiled graph); drop --compile or cp"
            )
        if cfg.model.startswith("hf:") and sizes.get("pp", 1) > 1:
            problems.append(
                "pp with cp is not supported for hf: models yet (their pipeline stages cut "
                "transformers' forward, which does not take the data path's positions there); use a "
                "mesh without pp or without cp"
            )
    return problems


def model_problems(cfg, world_size: int, sizes: dict, model_cfg) -> list[str]:
    """The model against the mesh and the sequence, and the pipeline (pp) settings."""
    problems = []
    if model_cfg is not None and cfg.init_from_hf and hasattr(model_cfg, "init_problem"):
        problem = model_cfg.init_problem(cfg.init_from_hf)
        if problem is not None:
            problems.append(f"--init-from-hf {cfg.init_from_hf}: {problem}")
    problems += _float8_problems(cfg)
    if model_cfg is not None and cfg.compile and getattr(model_cfg, "n_experts", 0):
        problems.append(
            "--compile with a mixture of experts is not supported (the token dispatch's split sizes "
            "depend on the routing, so torch.compile recompiles for every step); leave --compile out"
        )
    if model_cfg is not None:
        problem = model_cfg.mesh_problem(sizes)
        if problem is not None:
            problems.append(f"--mesh {format_sizes(sizes)}: {problem}")
        if cfg.seq_len > model_cfg.max_seq_len:
            problems.append(
                f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}; "
                f"use --seq-len {model_cfg.max_seq_len} or less"
            )
    pp = sizes.get("pp", 1)
    if world_size == 1 and cfg.offload:
        problems.append("--offload needs a mesh (torchrun with 2+ processes); one process trains plain PyTorch")
    if pp > 1 and model_cfg is not None:
        problems += _pipeline_problems(cfg, world_size, sizes, model_cfg)
    return problems


def _float8_problems(cfg) -> list[str]:
    """--float8 needs torchao (whether the model has a linear layer to convert, spmd.float8_training says)."""
    if not cfg.float8:
        return []
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return [f"--float8 needs torchao, which is not installed: {FLOAT8_INSTALL}, or leave --float8 out"]
    return []


def _pipeline_problems(cfg, world_size: int, sizes: dict, model_cfg) -> list[str]:
    problems = []
    try:
        validate_pipeline(
            sizes["pp"],
            cfg.pp_schedule,
            cfg.pipeline_microbatches(world_size),
            cfg.virtual_stages,
            n_blocks=model_cfg.n_layers,
            batch_size=cfg.batch_size // cfg.grad_accum,
            data_parallel=cfg.rules().data_parallel_size(sizes),
            world=world_size,
        )
    except ValueError as e:
        problems.append(str(e))
    if getattr(model_cfg, "pipeline_ties", False):  # the first and last stage both hold the tied weight
        if model_cfg.tie_embeddings and cfg.pp_schedule == "zbv":
            problems.append(
                "--pp-schedule zbv puts the first and last stage on one rank, which a tied head (one "
                "weight in both) does not allow; use interleaved-1f1b or zero-bubble"
            )
    elif model_cfg.tie_embeddings:
        problems.append(
            "pipeline parallelism needs untied embeddings (the first and last stage would share one "
            "weight); use a model without tied embeddings"
        )
    return problems
