"""The optimizer step of a dry run (explain, with or without pp): what spmd.shard_optimizer's step
communicates, and spmd.Muon's exchanges of whole matrices, recorded without updating anything."""

import torch

from ..optim import Muon, WholeMatrixPlan
from ..runtime.optimizer.masters import gather_updated
from ..runtime.optimizer.shard import masters_of, reduce_gradients, shard_optimizer
from .record import Collective

__all__ = ["OPTIMIZERS", "planning_optimizer", "record_optimizer_step", "muon_exchanges"]

OPTIMIZERS = ("adamw", "adam", "sgd", "muon")  # what explain's `optimizer=` names


def planning_optimizer(model, optimizer: str = "adamw") -> torch.optim.Optimizer:
    """The trainer's optimizer on `model`'s parameters (spmd.Muon for `muon`, else an AdamW) prepared by
    spmd.shard_optimizer, before the first backward (from then on ZeRO-1's backward holds gradients for the
    step). Made outside the fake mode: the masters' offsets are then plain ints."""
    base = Muon(model) if optimizer == "muon" else torch.optim.AdamW(model.parameters(), lr=0.0)
    return shard_optimizer(model, base)


def record_optimizer_step(model, opt, optimizer: str, recorder, fake) -> None:
    """What a sharded optimizer's step communicates: the reduce-scatters of the gradients ZeRO-1's backward
    left unreduced, Muon's two all-to-alls (muon_exchanges), and the all-gathers of updated shards into the
    parameters (none when every parameter is its own master, as under ZeRO-3). The update itself moves
    nothing and is not run."""
    with fake, recorder:
        reduce_gradients(model)
    if optimizer == "muon":
        recorder.records.extend(muon_exchanges(opt))
    with fake, recorder:
        if masters_of(opt) and optimizer in ("adam", "adamw", "muon"):
            gather_updated(opt)


def muon_exchanges(opt: Muon) -> list[Collective]:
    """spmd.Muon's step as plan rows: the all-to-all that brings each matrix whole to its owner rank and the
    one that sends the orthogonalised shards back (spmd.optim.whole_matrix). Ranks move different bytes (each
    owns other matrices): a row's `per_rank` lists each rank's (by global rank), bytes it sends to the others
    as the recorder counts an all-to-all, and its `bytes` is the busiest rank's."""
    matrices = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    if not matrices:
        return []
    plan = WholeMatrixPlan.of(matrices)
    order = sorted(range(plan.world), key=lambda i: plan.ranks[i])
    mesh = matrices[0].device_mesh
    axes = tuple(a for a, n in zip(mesh.mesh_dim_names, mesh.mesh.shape) if n > 1)
    moved, rows = plan.exchanges(matrices[0].to_local().element_size()), []
    for what, why in (
        ("gather", "Muon: each matrix whole to its owner rank"),
        ("scatter", "Muon: orthogonalised shards back from the owners"),
    ):
        sent = tuple(moved[what]["sent"][i] for i in order)
        rows.append(
            Collective(
                module="(optimizer)",
                op=f"spmd.optim.whole_matrix.{what}",
                kind="all_to_all",
                axes=axes,
                bytes=max(sent),
                phase="optimizer",
                reason=f"{why} ({len(matrices)} matrices, {min(sent):,}-{max(sent):,} B per rank)",
                dtype=str(matrices[0].dtype).replace("torch.", ""),
                per_rank=sent,
            )
        )
    return rows
