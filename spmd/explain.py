"""`explain(model, rules, mesh_sizes, batch_shape)`: what a training step will do, without the devices.

It lays a meta-tensor copy of the model out on a fake process group of the requested world size, runs
one forward and backward with the collective recorder on, and returns the `Plan`: the same code path
as a real run, so the plan lists the collectives a real step issues, no more and no fewer.
"""
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from . import record
from .mesh import MESH_AXES, check_sizes, make_mesh, mesh_sizes
from .parallelize import STATE_ATTR, parallelize
from .plan import Plan
from .reshard import observe_saved

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fake_copy(model: nn.Module, mode: FakeTensorMode | None) -> nn.Module:
    """A copy of `model` whose tensors hold no data (fake CPU tensors under `mode`, else meta tensors),
    annotations kept, without copying any weights."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if mode is None:
            clone = torch.empty_like(t, device="meta")
        else:
            with mode:
                clone = torch.empty_like(t, device="cpu")
        if isinstance(t, nn.Parameter):
            clone = nn.Parameter(clone, requires_grad=t.requires_grad)
        clone.__dict__.update({k: v for k, v in t.__dict__.items() if k.startswith("_spmd")})
        memo[id(t)] = clone
    return copy.deepcopy(model, memo)


def explain(model: nn.Module, rules, mesh_or_sizes, batch_shape=(8, 2048), dtype=torch.float32,
            optimizer: str = "adamw", *, schedule: str = "1f1b", microbatches: int | None = None,
            virtual_stages: int = 1, split_cost: str = "flops") -> Plan:
    """Plans one training step of `model` (forward, backward, gradient reduction) on a mesh of any size.

    `mesh_or_sizes`: a DeviceMesh or a dict like {"fsdp": 8, "tp": 8}. `batch_shape`: the global
    (batch, seq) of token ids. `dtype`: the compute dtype (parameters are gathered in it; master weights,
    gradients and optimizer states stay fp32). With a `pp` axis, the step is spmd.build_pipeline's with
    these `schedule`, `microbatches`, `virtual_stages` and `split_cost`, and the plan has a `pipeline`
    section (stages, bubble, send/recv bytes; see spmd/pipeline_plan.py).
    """
    pipeline = dict(schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                    split_cost=split_cost)
    if hasattr(model, STATE_ATTR):
        raise ValueError("explain takes the model before spmd.parallelize (a parallelized copy is laid out already)")
    sizes = mesh_or_sizes if isinstance(mesh_or_sizes, dict) else dict(
        zip(mesh_or_sizes.mesh_dim_names, mesh_or_sizes.shape))
    check_sizes(sizes)
    dtype = _DTYPES.get(dtype, dtype)
    if dist.is_initialized() and dist.get_backend() != "fake":
        return _explain_in_child(model, rules, sizes, batch_shape, dtype, optimizer, pipeline)
    return _dry_run(model, rules, sizes, tuple(batch_shape), dtype, optimizer, pipeline)


def _dry_run(model, rules, sizes, batch_shape, dtype, optimizer, pipeline=None) -> Plan:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    world = 1
    for s in sizes.values():
        world *= s
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    _clear_dtensor_caches()
    # Fake CPU tensors rather than meta: ops such as attention pick their kernel by device.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        mesh = make_mesh(sizes, device_type="cpu")
        if sizes.get("pp", 1) > 1:
            from .pipeline_plan import plan_pipeline
            records, decisions, memory, section = plan_pipeline(model, rules, mesh, batch_shape, dtype, optimizer,
                                                                fake, **(pipeline or {}))
            return Plan(mesh={a: mesh_sizes(mesh)[a] for a in MESH_AXES}, batch_shape=batch_shape,
                        dtype=str(dtype).replace("torch.", ""), collectives=records, decisions=decisions,
                        memory=memory, pipeline=section)
        param_dtype = None if dtype == torch.float32 else dtype
        model = fake_copy(model, fake)
        with fake:
            parallelize(model, mesh, rules, param_dtype=param_dtype)
        full = mesh_sizes(mesh)
        data_parallel = full["dp"] * full["fsdp"]
        batch, seq = batch_shape[0], batch_shape[1]
        if batch % data_parallel:
            raise ValueError(f"batch {batch} does not divide by the data-parallel size dp*fsdp={data_parallel}")
        recorder = record.CollectiveRecorder(mesh)
        saved = {}
        with fake:
            tokens = torch.zeros(batch // data_parallel, seq, dtype=torch.long)
            with recorder, observe_saved(saved):
                loss = model(tokens, tokens)
            activations = sum(saved.values())
            with recorder:
                loss.backward()
        plan = Plan(mesh={a: full[a] for a in MESH_AXES}, batch_shape=batch_shape,
                    dtype=str(dtype).replace("torch.", ""), collectives=recorder.records,
                    decisions=list(getattr(model, STATE_ATTR).decisions.values()))
        plan.memory = memory_per_rank(model, optimizer, activations)
        return plan
    finally:
        dist.destroy_process_group()


def _clear_dtensor_caches():
    """DTensor caches sharding and redistribution plans by spec, and meshes compare equal by layout, not by
    process group: a plan cached in an earlier fake world would carry that world's groups into this one."""
    from torch.distributed.tensor import _redistribute
    for clear in (getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
                  getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)):  # the C++ fast path's
        if clear is not None:
            clear()


def local_bytes(t) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def memory_per_rank(model: nn.Module, optimizer: str, activations: int = 0) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states, from the local shards."""
    params = sum(local_bytes(p) for p in model.parameters())
    states = {"adamw": 2, "adam": 2, "sgd": 0}[optimizer]
    mem = {"parameters": params, "gradients": params, "optimizer": states * params, "activations": activations}
    mem["total"] = sum(mem.values())
    return mem


def _explain_in_child(model, rules, sizes, batch_shape, dtype, optimizer, pipeline=None) -> Plan:
    # a real process group owns this process; the fake world runs in a fresh interpreter next door
    with tempfile.TemporaryDirectory() as tmp:
        job, out = os.path.join(tmp, "job.pt"), os.path.join(tmp, "plan.json")
        torch.save((fake_copy(model, None), rules, sizes, tuple(batch_shape), dtype, optimizer, pipeline), job)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        subprocess.run([sys.executable, "-m", "spmd.explain_child", job, out], check=True, env=env)
        with open(out) as f:
            return Plan.from_dict(json.load(f))
