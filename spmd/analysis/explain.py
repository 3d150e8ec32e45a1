"""`explain(model, rules, mesh_sizes, batch_shape)`: what a training step will do, without the devices.

It lays a meta-tensor copy of the model out on a fake process group of the requested world size, runs
one forward and backward with the collective recorder on, and returns the `Plan`: the same code path
as a real run, so the plan lists the collectives a real step issues, no more and no fewer.
"""

import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from ..float8 import float8_notes
from ..layout.annotate import fake_copy
from ..layout.dtypes import as_dtype
from ..layout.mesh import MESH_AXES, check_sizes, mesh_sizes
from ..layout.sequence import check_seq_len, rank_positions
from ..runtime import dtensor
from ..runtime.activations import attention_memory
from ..runtime.parallelize import no_sync, parallelize
from ..runtime.parameters.reshard import observe_saved
from ..runtime.state import STATE_ATTR
from ..runtime.transforms.checkpointing import apply_activation_checkpointing, parse_mode
from ..runtime.wire.hpz import secondary_bytes
from . import record
from .explain_pipeline import explain_pipeline
from .fake import fake_world
from .memory import activation_bytes, local_bytes, memory_per_rank, peak_bytes, unreduced_bytes, wire_buffer_bytes
from .optimizer_step import OPTIMIZERS, planning_optimizer, record_optimizer_step
from .plan import Plan

__all__ = ["explain", "dry_run", "training_loss"]


def explain(
    model: nn.Module,
    rules,
    mesh_or_sizes,
    batch_shape=(8, 2048),
    dtype=torch.float32,
    optimizer: str = "adamw",
    *,
    ac: str = "none",
    grad_accum: int = 1,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int = 1,
    split_cost: str = "flops",
    reduce_dtype=torch.float32,
    master: str = "params",
    offload: str | None = None,
    comm: dict | None = None,
) -> Plan:
    """Plans one training step of `model` (forward, backward, gradient reduction) on a mesh of any size.

    `mesh_or_sizes`: a DeviceMesh or a dict like {"fsdp": 8, "tp": 8}. `batch_shape`: the global
    (batch, seq) of token ids. `dtype`: the compute dtype (parameters are gathered in it; master weights,
    gradients and optimizer states stay fp32). With a `pp` axis, the step is spmd.build_pipeline's with
    these `schedule`, `microbatches`, `virtual_stages` and `split_cost`, and the plan has a `pipeline`
    section (stages, bubble, send/recv bytes; see spmd/analysis/explain_pipeline.py). `ac`: activation
    checkpointing of the blocks as the trainer applies it (`none`, `full`, `selective:N`): saved activations
    shrink, and the recomputation's collectives join the backward. `grad_accum`: micro-batches per step as the
    trainer runs them (--grad-accum K): K forward/backward passes of batch/K, the first K-1 under `no_sync`;
    the plan lists every pass's collectives, the activations of one micro-batch and, for K > 1, the gradients
    the passes accumulate unreduced (their compute layout).
    `optimizer`: `adamw` (or `adam`, `sgd`: the states memory counts) or `muon` (spmd.Muon: the step's two
    all-to-alls of whole matrices join the phase `optimizer`, each rank's bytes in a row's `per_rank`, and
    the plan's totals are the busiest rank's; one momentum per Muon matrix, AdamW's two states elsewhere).

    The ZeRO stage is the rules' (`Rules.default(zero=k)`): with optimizer or grads maps that shard beyond
    the params map the step includes spmd.shard_optimizer's AdamW step, its all-gathers and, under ZeRO-1, the
    reduce-scatters of the gradients backward left unreduced (phase `optimizer`). `reduce_dtype`, `master`
    and `offload` mean what they mean to `parallelize`; `plan.memory` counts each state in its layout and
    dtype, host bytes apart (spmd/analysis/memory.py), and `plan.memory["peak"]` is the most tensor bytes a rank
    holds during the step (memory.peak_bytes; not given under `offload` or with a `pp` axis). `comm`: the
    wire precision, as `parallelize` takes it: collectives count their quantized bytes (payload + scales)
    and `plan.memory["wire"]` the packed buffers of the largest quantized collective, `plan.memory["hpz"]`
    hpZ's secondary parameter copies (both in the total).
    """
    dtensor.install()
    pipeline = dict(schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages, split_cost=split_cost)
    if hasattr(model, STATE_ATTR):
        raise ValueError("explain takes the model before spmd.parallelize (a parallelized copy is laid out already)")
    sizes = (
        mesh_or_sizes
        if isinstance(mesh_or_sizes, dict)
        else dict(zip(mesh_or_sizes.mesh_dim_names, mesh_or_sizes.shape))
    )
    check_sizes(sizes)
    dtype = as_dtype(dtype)
    parse_mode(ac)
    precision = dict(reduce_dtype=as_dtype(reduce_dtype), master=master, offload=offload)
    if comm is not None:
        precision["comm"] = comm
    _check_grad_accum(grad_accum, sizes)
    _check_optimizer(optimizer, sizes, offload)
    if dist.is_initialized() and dist.get_backend() != "fake":
        plan = _explain_in_child(
            model, rules, sizes, batch_shape, dtype, optimizer, pipeline, ac, precision, grad_accum
        )
    else:
        plan = dry_run(model, rules, sizes, tuple(batch_shape), dtype, optimizer, pipeline, ac, precision, grad_accum)
    plan.notes += float8_notes(model, sizes)
    return plan


def _check_grad_accum(grad_accum, sizes: dict) -> None:
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an integer >= 1 (micro-batches per step), got {grad_accum!r}")
    if grad_accum > 1 and sizes.get("pp", 1) > 1:
        raise ValueError(
            "explain does not plan grad_accum > 1 with a pp axis yet; pass grad_accum=1 and give "
            "the pipeline its micro-batches with microbatches="
        )


def _check_optimizer(optimizer, sizes: dict, offload) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one explain plans; use one of {', '.join(OPTIMIZERS)}")
    if optimizer == "muon" and (sizes.get("pp", 1) > 1 or offload):
        raise ValueError(
            "spmd.Muon exchanges whole matrices over the whole mesh on the device: plan it on a mesh "
            "without pp and without offload"
        )


def dry_run(
    model, rules, sizes, batch_shape, dtype, optimizer, pipeline=None, ac="none", precision=None, grad_accum=1
) -> Plan:
    """The plan of one step, laid out and run in a fake world of `sizes` (this process's group is replaced)."""
    with fake_world(sizes) as (mesh, fake):
        full = mesh_sizes(mesh)
        common = dict(
            mesh={a: full[a] for a in MESH_AXES}, batch_shape=batch_shape, dtype=str(dtype).replace("torch.", "")
        )
        if full["pp"] > 1:
            records, decisions, memory, section = explain_pipeline(
                model, rules, mesh, batch_shape, dtype, optimizer, fake, **(pipeline or {}), ac=ac, precision=precision
            )
            return Plan(**common, collectives=records, decisions=decisions, memory=memory, pipeline=section)
        model = fake_copy(model, fake)
        with fake:
            parallelize(model, mesh, rules, param_dtype=None if dtype == torch.float32 else dtype, **(precision or {}))
        apply_activation_checkpointing(model, ac)
        data_parallel = rules.data_parallel_size(mesh)
        batch, seq = batch_shape[0], batch_shape[1]
        check_seq_len(seq, full["cp"])
        if batch % (data_parallel * grad_accum):
            raise ValueError(
                f"batch {batch} does not divide by the data-parallel size "
                f"{'*'.join(rules.batch_axes())}={data_parallel} times grad_accum={grad_accum}"
            )
        recorder = record.CollectiveRecorder(mesh)
        opt = planning_optimizer(model, optimizer)
        with fake:
            tokens = torch.zeros(batch // (data_parallel * grad_accum), seq // full["cp"], dtype=torch.long)
            positions = rank_positions(tokens.shape, mesh)
            activations, unreduced, attention = _run_step(model, recorder, tokens, grad_accum, positions)
        record_optimizer_step(model, opt, optimizer, recorder, fake)
        memory = memory_per_rank(model, optimizer, activations)
        if unreduced > memory["gradients"]:  # held until the last micro-batch's backward reduces them
            memory["total"] += unreduced - memory["gradients"]
            memory["gradients"] = unreduced
        _wire_memory(memory, model, recorder.records, full)
        if not (precision or {}).get("offload"):  # offloaded states move through host memory: not modelled
            buffers = sum(local_bytes(b) for b in model.buffers())
            memory["peak"] = peak_bytes(memory, *unreduced_bytes(model, getattr(model, STATE_ATTR)), buffers)
        return Plan(
            **common,
            collectives=recorder.records,
            decisions=list(getattr(model, STATE_ATTR).decisions.values()),
            memory=memory,
            attention=attention,
        )


def _wire_memory(memory: dict, model, records, sizes: dict) -> None:
    """What `comm` adds: the packed buffers of the largest quantized collective, hpZ's secondary copies."""
    state = getattr(model, STATE_ATTR)
    if state.wire is not None and state.wire.compressed:
        memory["wire"] = wire_buffer_bytes(records, sizes)
        memory["total"] += memory["wire"]
    if state.wire is not None and state.wire.hpz is not None:
        memory["hpz"] = secondary_bytes(model, state)
        memory["total"] += memory["hpz"]


def _run_step(model: nn.Module, recorder, tokens, grad_accum: int, positions=None) -> tuple[int, int, dict]:
    """Forward and backward of `grad_accum` micro-batches, the first ones under no_sync, as the trainer runs
    them. Returns (activation bytes of one micro-batch, bytes of the gradients accumulated unreduced, attention's
    memory in one micro-batch: bytes it saves for backward and the peak one call holds)."""
    unreduced = 0
    for i in range(grad_accum):
        saved, attention = {}, {}
        sync = contextlib.nullcontext() if i == grad_accum - 1 else no_sync(model)
        with attention_memory.observe(attention):
            with recorder, observe_saved(saved):
                loss = training_loss(model, tokens, positions)
            activations = activation_bytes(saved, model)
            with recorder, sync:
                loss.backward()
        if i == grad_accum - 2:
            unreduced = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    return activations, unreduced, {"saved": sum(attention["saved"].values()), "peak": attention["peak"]}


def training_loss(model: nn.Module, tokens: torch.Tensor, positions=None) -> torch.Tensor:
    """The loss of a language model on `tokens` as its own targets: `model(input_ids=, labels=)` for a model
    whose forward takes those (Hugging Face, which shifts the labels itself), else `model(tokens, targets)`
    (with `positions=` under cp);
    the scalar is found in a returned ModelOutput, dict or tuple."""
    params = inspect.signature(model.forward).parameters
    out = (
        model(input_ids=tokens, labels=tokens)
        if "input_ids" in params and "labels" in params
        else model(tokens, tokens, **({} if positions is None else {"positions": positions}))
    )
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
    loss = next((v for v in values if isinstance(v, torch.Tensor) and v.ndim == 0), None)
    if loss is None:
        raise ValueError(
            f"{type(model).__name__}'s forward returned no scalar loss; explain needs a forward "
            f"that takes (tokens, targets), or input_ids= and labels=, and returns the loss"
        )
    return loss


def _explain_in_child(
    model, rules, sizes, batch_shape, dtype, optimizer, pipeline=None, ac="none", precision=None, grad_accum=1
) -> Plan:
    # a real process group owns this process; the fake world runs in a fresh interpreter next door
    with tempfile.TemporaryDirectory() as tmp:
        job, out = os.path.join(tmp, "job.pt"), os.path.join(tmp, "plan.json")
        torch.save(
            (
                fake_copy(model, None),
                rules,
                sizes,
                tuple(batch_shape),
                dtype,
                optimizer,
                pipeline,
                ac,
                precision,
                grad_accum,
            ),
            job,
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        subprocess.run([sys.executable, "-m", "spmd.analysis.explain_child", job, out], check=True, env=env)
        with open(out) as f:
            return Plan.from_dict(json.load(f))
