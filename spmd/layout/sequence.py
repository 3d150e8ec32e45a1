"""The sequence split over the `cp` mesh axis: which positions each context-parallel rank holds.

The sequence is cut into 2·cp equal chunks and cp rank i holds chunks i and 2·cp-1-i (a "zigzag"): under
a causal mask the early chunk attends to little and the late one to much, so every rank does the same
attention work. The data path gives each rank its positions' tokens, targets and RoPE positions; the
model's global view is then the sequence in zigzag order, which token-wise layers never notice and ring
attention (spmd.runtime.context_parallel.ring) undoes.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_seq_len", "zigzag_positions", "rank_positions", "cp_rank", "cp_slice"]


def check_seq_len(seq_len: int, cp: int) -> None:
    """Raises a ValueError naming the fix when `seq_len` tokens do not split into 2·cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        fit = seq_len - seq_len % (2 * cp)
        raise ValueError(
            f"sequence length {seq_len} does not split over cp={cp}: context parallelism cuts the "
            f"sequence into 2*cp={2 * cp} equal chunks (two per rank, for causal load balance); use a "
            f"length that is a multiple of {2 * cp} (e.g. {fit or 2 * cp}) or a smaller cp"
        )


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions cp rank `rank` of `cp` holds, in order: chunk `rank`, then chunk 2·cp-1-rank."""
    check_seq_len(seq_len, cp)
    if cp == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def rank_positions(local_shape, mesh: DeviceMesh, rank: int = 0) -> torch.Tensor | None:
    """Positions [batch, seq] of cp rank `rank`'s share for a local token batch of `local_shape`, or None
    without an active cp axis (a plan's dry run: any rank's positions move the same bytes)."""
    cp = dict(zip(mesh.mesh_dim_names, mesh.shape)).get("cp", 1)
    if cp == 1:
        return None
    return zigzag_positions(local_shape[1] * cp, cp, rank).expand(local_shape[0], -1).contiguous()


def cp_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process on the mesh's cp axis; (0, 1) when the mesh has none."""
    if "cp" not in (mesh.mesh_dim_names or ()):
        return 0, 1
    return mesh.get_local_rank("cp"), mesh.size(mesh.mesh_dim_names.index("cp"))


def cp_slice(t: torch.Tensor, mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of `t` along its sequence dim `dim` (all of it without cp)."""
    rank, cp = cp_rank(mesh)
    if cp == 1:
        return t
    return t.index_select(dim, zigzag_positions(t.shape[dim], cp, rank).to(t.device))
