"""The pipeline part of `spmd.explain`: what one training step does on each pp rank, without the devices.

Inside explain's fake world, every stage module is built and laid out exactly as `build_pipeline` does
(on the mesh without pp), and runs one micro-batch's forward and backward under the collective recorder
twice: once with gradient reduction off and once with it on, as the schedule runs M-1 and 1 of them. A pp
rank's step is then the records of its stages (M-1 times the first, once the second) plus the sends and
receives of activations and gradients between stages on different ranks. The backward is a full one, so
zero-bubble schedules, which split it in two, may regather FSDP parameters a few more times than listed.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..layout.annotate import fake_copy
from ..layout.blocks import find_blocks
from ..layout.rules import local_shape
from ..layout.sequence import rank_positions
from ..pipeline.runtime import bubble_fraction, default_microbatches, validate_pipeline
from ..pipeline.split import split_stages
from ..pipeline.stage import LocalModel, StageModule, has_parts
from ..pipeline.stage_layout import lay_out_stage, without_pp
from ..runtime.parameters.reshard import observe_saved
from ..runtime.state import STATE_ATTR
from ..runtime.transforms.checkpointing import parse_mode
from . import record
from .memory import activation_bytes, memory_per_rank
from .optimizer_step import planning_optimizer, record_optimizer_step

__all__ = ["explain_pipeline"]

HIDDEN_AXES, TOKEN_AXES = ("batch", "seq", "embed"), ("batch", None)


def explain_pipeline(
    model,
    rules,
    mesh,
    batch_shape,
    dtype,
    optimizer,
    fake,
    schedule="1f1b",
    microbatches=None,
    virtual_stages=1,
    split_cost="flops",
    blocks=None,
    ac="none",
    precision=None,
):
    """(collectives, decisions, memory, pipeline section) of the pp rank whose memory is largest. `precision`:
    spmd.parallelize's reduce_dtype, master and offload, for every stage."""
    _, stage_mesh = without_pp(mesh)
    # the stage group of pp rank 0 as a mesh of its own: a sliced mesh computes its rank layout with ops
    # that fake tensors cannot run
    stage_mesh = DeviceMesh(
        "cpu", torch.arange(stage_mesh.size()).reshape(stage_mesh.shape), mesh_dim_names=stage_mesh.mesh_dim_names
    )
    pp, v = mesh.size(mesh.mesh_dim_names.index("pp")), virtual_stages
    m = microbatches or default_microbatches(schedule, pp)
    n_dp = rules.data_parallel_size(stage_mesh)
    validate_pipeline(pp, schedule, m, v, len(find_blocks(model, blocks)[1]), batch_shape[0], n_dp)
    if not has_parts(model):
        raise ValueError(
            f"explain with a pp axis plans models with embed/block_inputs/head methods; "
            f"{type(model).__name__} has none (spmd.build_pipeline trains it, its forward cut at the "
            f"blocks, but explain does not plan such stages yet): plan it without pp"
        )
    split = split_stages(
        model,
        pp * v,
        split_cost,
        blocks,
        pp=pp,
        style="v" if schedule == "zbv" else "loop",
        example_inputs=(torch.zeros(batch_shape, dtype=torch.long),),
    )
    meta = fake_copy(model, None)
    mb_global = (batch_shape[0] // m,) + tuple(batch_shape[1:])
    h = type(meta).embed(meta, torch.zeros(mb_global, dtype=torch.long, device="meta"))
    param_dtype = None if dtype == torch.float32 else dtype
    hidden_dtype = param_dtype or h.dtype
    hidden = local_shape(tuple(h.shape), HIDDEN_AXES, stage_mesh, rules)
    hidden_bytes = torch.Size(hidden).numel() * hidden_dtype.itemsize
    cp = dict(zip(stage_mesh.mesh_dim_names, stage_mesh.shape)).get("cp", 1)
    tokens = (mb_global[0] // n_dp,) + ((mb_global[1] // cp,) if len(mb_global) > 1 else ()) + mb_global[2:]

    fake_model = fake_copy(model, fake)
    runs, decisions, saved, state = _run_stages(
        split,
        fake_model,
        stage_mesh,
        rules,
        param_dtype,
        fake,
        tokens,
        hidden,
        hidden_dtype,
        m,
        parse_mode(ac),
        schedule,
        optimizer,
        precision or {},
    )

    ranks = []
    for r in range(pp):
        mine = split.stages_of_rank(r)
        records = []
        for info in mine:
            records += runs[info.index][False] * (m - 1) + runs[info.index].get(True, []) + runs[info.index]["step"]
            records += _p2p(split, info, m, hidden_bytes, hidden, hidden_dtype)
        in_flight = m if schedule == "gpipe" else min(m, pp)
        local = LocalModel(fake_model, split, [s.index for s in mine])
        memory = memory_per_rank(local, optimizer, in_flight * sum(saved[s.index] for s in mine), state=state)
        ranks.append(
            {
                "rank": r,
                "stages": [s.index for s in mine],
                "records": records,
                "memory": memory,
                "comm_bytes_per_step": sum(c.bytes for c in records),
            }
        )
    worst = max(ranks, key=lambda x: x["memory"]["total"])
    section = _section(split, schedule, pp, m, v, hidden_bytes, hidden, runs, ranks, worst)
    return worst["records"], decisions, worst["memory"], section


def _run_stages(
    split,
    fake_model,
    stage_mesh,
    rules,
    param_dtype,
    fake,
    tokens,
    hidden,
    hidden_dtype,
    m,
    every,
    schedule,
    optimizer,
    precision,
):
    """Each stage laid out and run for one micro-batch, with gradient reduction off and on, then its share of
    the optimizer step (ZeRO-1's reduce-scatter into the optimizer's shards, the all-gather of updated shards
    under ZeRO-1/2; nothing under ZeRO-3): ({stage: {sync: records, "step": records}}, decisions, {stage:
    bytes autograd saved}, the state of the stages' layout)."""
    runs, decisions, saved = {}, [], {}
    for info in split.stages:
        with fake:
            stage = StageModule(fake_model, split, info.index, HIDDEN_AXES)
            lay_out_stage(
                stage,
                info,
                stage_mesh,
                rules,
                schedule,
                every,
                fake_model.get_submodule(split.block_path),
                hidden_axes=HIDDEN_AXES,
                token_axes=TOKEN_AXES,
                param_dtype=param_dtype,
                **precision,
            )
            x = (
                torch.zeros(tokens, dtype=torch.long)
                if info.first
                else torch.zeros(hidden, dtype=hidden_dtype, requires_grad=True)
            )
            targets = torch.zeros(tokens, dtype=torch.long)
            positions = rank_positions(tokens, stage_mesh)
        state = getattr(stage, STATE_ATTR)
        opt = planning_optimizer(stage)
        runs[info.index] = {}
        for sync in (False, True) if m > 1 else (True,):
            state.sync = sync
            recorder, seen = record.CollectiveRecorder(stage_mesh), {}
            with fake:
                with recorder, observe_saved(seen):
                    out = stage(x, targets=targets, positions=positions)
                with recorder:
                    out.backward(None if info.last else torch.ones_like(out))
            runs[info.index][sync] = recorder.records
            saved[info.index] = activation_bytes(seen, stage)
        state.sync = True
        recorder = record.CollectiveRecorder(stage_mesh)
        record_optimizer_step(stage, opt, optimizer, recorder, fake)
        runs[info.index]["step"] = recorder.records
        decisions.extend(state.decisions.values())
    return runs, decisions, saved, state


def _section(split, schedule, pp, m, v, hidden_bytes, hidden, runs, ranks, worst) -> dict:
    """The `pipeline` section of the plan."""
    return {
        "schedule": schedule,
        "pp": pp,
        "microbatches": m,
        "virtual_stages": v,
        "bubble": bubble_fraction(schedule, pp, m, v),
        "split_cost": split.cost,
        "imbalance": split.imbalance(),
        "imbalance_flops": split.imbalance("flops"),
        "imbalance_params": split.imbalance("params"),
        "send_recv_bytes_per_microbatch": hidden_bytes,
        "activation_shape": list(hidden),
        "stages": [
            {
                **{k: getattr(s, k) for k in ("index", "rank", "params", "flops", "first", "last")},
                "blocks": [s.blocks[0], s.blocks[-1]],
                "comm_bytes_per_microbatch": sum(c.bytes for c in runs[s.index][False if m > 1 else True]),
            }
            for s in split.stages
        ],
        "ranks": [
            {k: x[k] for k in ("rank", "stages", "comm_bytes_per_step")} | {"memory_total": x["memory"]["total"]}
            for x in ranks
        ],
        "reported_rank": worst["rank"],
        "block_path": split.block_path,
        "pre": split.pre,
        "post": split.post,
    }


def _p2p(split, info, m, nbytes, shape, dtype):
    """Sends and receives of one stage over a step: activations forward, their gradients backward."""
    out = []

    def add(kind, phase, peer, why):
        out.append(
            record.Collective(
                module=f"stage {info.index}",
                op=f"pipelining.{kind}",
                kind=kind,
                axes=("pp",),
                bytes=nbytes,
                phase=phase,
                reason=why.format(peer=peer),
                origin="planned",
                dtype=str(dtype).replace("torch.", ""),
                shape=tuple(shape),
            )
        )

    for _ in range(m):
        prev = split.stages[info.index - 1] if not info.first else None
        nxt = split.stages[info.index + 1] if not info.last else None
        if prev is not None and prev.rank != info.rank:
            add("recv", "forward", prev.index, "activation from stage {peer}")
            add("send", "backward", prev.index, "gradient to stage {peer}")
        if nxt is not None and nxt.rank != info.rank:
            add("send", "forward", nxt.index, "activation to stage {peer}")
            add("recv", "backward", nxt.index, "gradient from stage {peer}")
    return out
