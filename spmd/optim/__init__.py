"""Optimizers that need more than a shard: Muon (whole matrices, spmd.optim.muon) and the mechanism that
brings a sharded matrix whole to one rank and its result back (spmd.optim.whole_matrix)."""
import torch.nn as nn

from .muon import NS_COEFFICIENTS, Muon, muon_param_groups, newton_schulz
from .whole_matrix import WholeMatrixPlan, box_of

__all__ = ["Muon", "muon_param_groups", "newton_schulz", "NS_COEFFICIENTS", "WholeMatrixPlan", "box_of",
           "muon_comm_bytes"]


def muon_comm_bytes(model: nn.Module, element_size: int = 4) -> list[int]:
    """Bytes each rank receives per Muon step for its gathers and scatters (index: position in the mesh), for
    a model laid out by spmd.parallelize; from shapes and placements alone (no communication)."""
    matrices, _ = muon_param_groups(model)
    return WholeMatrixPlan(matrices).bytes_per_rank(element_size) if matrices else []
