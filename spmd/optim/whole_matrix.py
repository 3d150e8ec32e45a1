"""Whole matrices from sharded DTensors: each matrix is brought whole to ONE rank of its mesh, a function runs
on it there, and the result goes back to the shards.

`WholeMatrixPlan.of(tensors)` decides, identically on every rank from shapes and placements alone, which rank
owns each matrix (greedy: the largest cost first, onto the least loaded rank) and which box of it every rank
holds. `plan.apply(locals_, fn)` then runs two `all_to_all_single` over the mesh's ranks:

- gather: every rank sends the local shard of each matrix to its owner; of replicas (a mesh dim that does
  not shard the matrix, e.g. `dp`) only those with the owner's coordinate on that dim send, so the owner
  receives each element once: about the matrix's bytes per matrix;
- scatter: the owner sends every rank the box of `fn(whole)` it holds: the matrix's bytes times the number
  of replicas.

With no replication that is ~2x the matrix per step, spread over the ranks as the owners are.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime import tags

__all__ = ["WholeMatrixPlan", "box_of"]


def box_of(shape, placements, mesh_shape, coord) -> tuple[list[int], list[int]]:
    """(offsets, lengths) of the box of a tensor of `shape` that the rank at mesh coordinate `coord` holds
    under `placements` (Shard / Replicate, nested in mesh-dim order as DTensor splits: ceil-sized chunks)."""
    offsets, lengths = [0] * len(shape), list(shape)
    for pl, n, c in zip(placements, mesh_shape, coord):
        if type(pl) is Shard:
            d = pl.dim
            chunk = math.ceil(lengths[d] / n) if lengths[d] else 0
            start = min(c * chunk, lengths[d])
            offsets[d] += start
            lengths[d] = max(0, min(chunk, lengths[d] - start))
        elif type(pl) is not Replicate:
            raise ValueError(
                f"whole-matrix optimizers handle Shard and Replicate placements, not {pl}; "
                f"reduce the gradient (spmd.reduce_gradients) before the step"
            )
    return offsets, lengths


class WholeMatrixPlan:
    """Owners and boxes of a list of 2-D DTensors sharing one device mesh (see the module docstring)."""

    def __init__(self, shapes, placements, mesh_shape, ranks=None, costs: list[float] | None = None):
        """From layouts alone: `shapes` and `placements` of each matrix on a mesh of `mesh_shape` whose flat
        positions are the global `ranks` (default 0..n-1). `of(tensors)` builds it from DTensors."""
        self.mesh_shape = tuple(int(n) for n in mesh_shape)
        self.world = math.prod(self.mesh_shape)
        self.ranks = list(ranks) if ranks is not None else list(range(self.world))
        self.me = self.ranks.index(dist.get_rank()) if dist.is_initialized() and self.world > 1 else 0
        self.shapes = [tuple(s) for s in shapes]
        self.placements = [tuple(p) for p in placements]
        costs = costs or [r * c * min(r, c) for r, c in self.shapes]  # Newton-Schulz FLOPs ~ rows*cols*min
        self.owners = _balance(costs, self.world)

    @classmethod
    def of(cls, tensors: list[DTensor]) -> "WholeMatrixPlan":
        mesh = tensors[0].device_mesh
        if any(t.device_mesh != mesh for t in tensors):
            raise ValueError(
                "whole-matrix optimizers need every matrix on one device mesh (a pipeline's stages "
                "each have their own); build one optimizer per stage's parameters"
            )
        if dist.is_initialized() and mesh.size() != dist.get_world_size():
            raise ValueError(
                f"whole-matrix optimizers exchange over every rank of the mesh; this mesh holds "
                f"{mesh.size()} of {dist.get_world_size()} processes (a pipeline stage?): use a "
                f"mesh without pp"
            )
        return cls(
            [t.shape for t in tensors], [t.placements for t in tensors], mesh.mesh.shape, mesh.mesh.flatten().tolist()
        )

    def box(self, m: int, rank_index: int):
        return box_of(self.shapes[m], self.placements[m], self.mesh_shape, _unravel(rank_index, self.mesh_shape))

    def sends_to_owner(self, m: int, rank_index: int) -> bool:
        """Whether this rank's shard of matrix m goes to its owner: it does where the rank agrees with the
        owner on every mesh dim that does not shard m (one replica of each distinct box)."""
        mine, owner = _unravel(rank_index, self.mesh_shape), _unravel(self.owners[m], self.mesh_shape)
        return all(a == b for a, b, pl in zip(mine, owner, self.placements[m]) if type(pl) is not Shard)

    def apply(self, shards: list[torch.Tensor], fn) -> list[torch.Tensor]:
        """Each rank's local shards of the matrices in, `fn(whole, m)` of each matrix out, as local shards."""
        if self.world == 1:
            return [fn(s, m) for m, s in enumerate(shards)]
        with tags.phase("optimizer"), tags.reason("(optimizer)", "whole matrices to their owners"):
            wholes = self._gather(shards)
        results = {m: fn(w, m) for m, w in wholes.items()}
        with tags.phase("optimizer"), tags.reason("(optimizer)", "results back to the shards"):
            return self._scatter(results, shards)

    def _gather(self, shards) -> dict[int, torch.Tensor]:
        send = [[] for _ in range(self.world)]
        for m, s in enumerate(shards):
            if self.sends_to_owner(m, self.me):
                send[self.owners[m]].append(s.reshape(-1))
        mine = [m for m, o in enumerate(self.owners) if o == self.me]
        sources = {m: [r for r in range(self.world) if self.sends_to_owner(m, r)] for m in mine}
        recv_sizes = [sum(math.prod(self.box(m, r)[1]) for m in mine if r in sources[m]) for r in range(self.world)]
        got, at = self._exchange(send, recv_sizes, shards[0]), [0] * self.world
        wholes = {}
        for m in mine:
            whole = shards[0].new_empty(self.shapes[m])
            for r in sources[m]:
                (r0, c0), (nr, nc) = self.box(m, r)
                whole[r0 : r0 + nr, c0 : c0 + nc] = got[r][at[r] : at[r] + nr * nc].view(nr, nc)
                at[r] += nr * nc
            wholes[m] = whole
        return wholes

    def _scatter(self, results: dict[int, torch.Tensor], shards) -> list[torch.Tensor]:
        send = [[] for _ in range(self.world)]
        for m in sorted(results):
            for r in range(self.world):
                (r0, c0), (nr, nc) = self.box(m, r)
                send[r].append(results[m][r0 : r0 + nr, c0 : c0 + nc].reshape(-1))
        recv_sizes = [sum(s.numel() for m, s in enumerate(shards) if self.owners[m] == r) for r in range(self.world)]
        got, at, out = self._exchange(send, recv_sizes, shards[0]), [0] * self.world, []
        for m, s in enumerate(shards):
            o = self.owners[m]
            out.append(got[o][at[o] : at[o] + s.numel()].view(s.shape))
            at[o] += s.numel()
        return out

    def _exchange(self, send: list[list[torch.Tensor]], recv_sizes: list[int], like: torch.Tensor) -> list:
        """One all_to_all_single over the default group; lists indexed by mesh position, ordered by global rank
        on the wire. Returns what each mesh position sent here."""
        order = sorted(range(self.world), key=lambda i: self.ranks[i])
        parts = {i: torch.cat(p) if p else like.new_empty(0) for i, p in enumerate(send)}
        out = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(
            out, torch.cat([parts[i] for i in order]), [recv_sizes[i] for i in order], [parts[i].numel() for i in order]
        )
        got, at = [None] * self.world, 0
        for i in order:
            got[i], at = out[at : at + recv_sizes[i]], at + recv_sizes[i]
        return got

    def bytes_per_rank(self, element_size: int = 4) -> list[int]:
        """Bytes each rank receives per apply (gather + scatter), from the plan alone."""
        moved = self.exchanges(element_size)
        return [g + s for g, s in zip(moved["gather"]["received"], moved["scatter"]["received"])]

    def exchanges(self, element_size: int = 4) -> dict:
        """Bytes per rank (index: mesh position) of each all-to-all of an apply, from the plan alone:
        {"gather" | "scatter": {"sent": [...], "received": [...]}}, counting only what crosses between ranks."""
        moved = {x: {"sent": [0] * self.world, "received": [0] * self.world} for x in ("gather", "scatter")}
        for m, o in enumerate(self.owners):
            for r in range(self.world):
                n = math.prod(self.box(m, r)[1]) * element_size
                if r == o:
                    continue
                if self.sends_to_owner(m, r):
                    moved["gather"]["sent"][r] += n
                    moved["gather"]["received"][o] += n
                moved["scatter"]["sent"][o] += n
                moved["scatter"]["received"][r] += n
        return moved


def _unravel(i: int, shape) -> tuple[int, ...]:
    coord = []
    for n in reversed(shape):
        coord.append(i % n)
        i //= n
    return tuple(reversed(coord))


def _balance(costs: list[float], world: int) -> list[int]:
    """Greedy longest-processing-time: each matrix, largest first, to the rank with the least work so far."""
    load, owners = [0.0] * world, [0] * len(costs)
    for m in sorted(range(len(costs)), key=lambda m: (-costs[m], m)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[m], load[r] = r, load[r] + costs[m]
    return owners
