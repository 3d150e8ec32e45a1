"""Optimizers that need more than a shard: Muon (whole matrices, spmd.optim.muon) and the mechanism that
brings a sharded matrix whole to one rank and its result back (spmd.optim.whole_matrix); 1-bit Adam
(spmd.optim.onebit_adam), whose momentum travels as signs and scales (spmd.optim.onebit_wire)."""

from types import SimpleNamespace

import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..layout.annotate import get_axes
from ..layout.mesh import MESH_AXES
from ..layout.rules import Rules, placements_for
from .muon import NS_COEFFICIENTS, Muon, muon_param_groups, newton_schulz
from .onebit_adam import OneBitAdam
from .onebit_wire import wire_bytes as onebit_wire_bytes
from .whole_matrix import WholeMatrixPlan, box_of

__all__ = [
    "Muon",
    "muon_param_groups",
    "newton_schulz",
    "NS_COEFFICIENTS",
    "WholeMatrixPlan",
    "box_of",
    "muon_comm_bytes",
    "OneBitAdam",
    "onebit_wire_bytes",
]


def muon_comm_bytes(
    model: nn.Module, rules: Rules | None = None, sizes: dict | None = None, element_size: int = 4
) -> list[int]:
    """Bytes each rank receives per Muon step for its gathers and scatters (index: position in the mesh), from
    layouts alone (no communication): of a model laid out by spmd.parallelize, or of a plain model whose
    matrices `rules`' optimizer map would lay out on a mesh of `sizes` (e.g. {"fsdp": 2, "tp": 2})."""
    matrices, _ = muon_param_groups(model)
    if not matrices:
        return []
    if isinstance(matrices[0], DTensor):
        return WholeMatrixPlan.of(matrices).bytes_per_rank(element_size)
    if rules is None or sizes is None:
        raise ValueError("muon_comm_bytes of a model not laid out needs the rules and the mesh sizes")
    names = [a for a in MESH_AXES if a in sizes]
    mesh = SimpleNamespace(mesh_dim_names=names, size=lambda i: sizes[names[i]])  # what placements_for reads
    placements = [
        placements_for(mesh, rules.mesh_axes(get_axes(p), "optimizer", "matrix"), p.shape, "matrix") for p in matrices
    ]
    plan = WholeMatrixPlan([p.shape for p in matrices], placements, [sizes[a] for a in names])
    return plan.bytes_per_rank(element_size)
