"""The layout decisions of the propagation pass.

DTensor's own op rules carry layouts through elementwise ops, views, attention and the loss. The pass
decides at the points where a layout must change, and makes each change an explicit, recorded move:

* a `constrain` point: the activation goes to the layout the rules give its logical axes, which turns
  tensor-parallel partial sums into an all-reduce, or a reduce-scatter under sequence parallelism;
* a linear layer: the input must fit the weight's compute layout. When both are sharded over one mesh
  axis on different dims (a sequence-sharded activation meets a column-parallel weight, or a pinned
  weight meets a batch-sharded activation), one of the two is gathered: the one with fewer bytes.
"""
from dataclasses import dataclass, asdict

from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass
class Decision:
    module: str
    mesh_axis: str
    choice: str              # "gather activation" | "gather weight"
    activation_bytes: int    # per rank, all-gather of the activation over mesh_axis
    weight_bytes: int        # per rank, all-gather of the weight over mesh_axis
    why: str = ""

    def to_dict(self):
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.module}: {self.choice} over {self.mesh_axis} "
                f"(activation {self.activation_bytes:,} B vs weight {self.weight_bytes:,} B per rank: {self.why})")


def gathered_bytes(shape, placements, mesh, dim: int, element_size: int) -> int:
    """Per-rank bytes an all-gather over mesh dim `dim` moves: the local size after it, times (n-1)/n."""
    numel = 1
    for s in shape:
        numel *= s
    for i, p in enumerate(placements):
        if i != dim and p.is_shard():
            numel //= mesh.size(i)
    n = mesh.size(dim)
    return numel * element_size * (n - 1) // n


def plan_linear(x: DTensor, w_shape, w_placements, w_element_size: int, module: str):
    """For `F.linear(x, w)`: the input layout to move to, the weight layout to use, and any decisions.

    Weight dims: 0 = out features, 1 = in features; x's last dim is the in-features dim.
    """
    mesh = x.device_mesh
    last = x.ndim - 1
    x_target = list(x.placements)
    w_target = list(w_placements)
    decisions = []
    for m, (xp, wp) in enumerate(zip(x.placements, w_placements)):
        if mesh.size(m) == 1:
            continue
        axis = mesh.mesh_dim_names[m]
        if xp.is_partial():
            # a partial sum cannot enter a matmul with a bias or a sharded weight: finish the sum here,
            # into the layout the weight wants (reduce-scatter onto in-features for a row-parallel weight)
            x_target[m] = Shard(last) if wp == Shard(1) else Replicate()
            continue
        x_sharded_elsewhere = xp.is_shard() and xp.dim != last
        if wp == Shard(0) and xp.is_shard() or wp == Shard(1) and x_sharded_elsewhere:
            act = gathered_bytes(x.shape, x.placements, mesh, m, x.element_size()) if xp.is_shard() else 0
            wb = gathered_bytes(w_shape, w_placements, mesh, m, w_element_size)
            # Gathering the weight keeps the layer data-parallel over this axis: sound when x is split on
            # the batch dim. Split on another token dim (sequence), attention downstream would need the
            # whole sequence, so the activation is gathered instead.
            if x_sharded_elsewhere and xp.dim == 0 and wb < act:
                w_target[m] = Replicate()
                decisions.append(Decision(module, axis, "gather weight", act, wb, "fewer bytes"))
            else:
                x_target[m] = Shard(last) if wp == Shard(1) else Replicate()
                why = ("fewer bytes" if act <= wb else "the input is split along a non-batch dim (sequence) that later ops need whole") \
                    if x_sharded_elsewhere else "the input is split along its features"
                decisions.append(Decision(module, axis, "gather activation", act, wb, why))
        elif wp == Shard(1) and not xp.is_shard():
            x_target[m] = Shard(last)  # a local slice, no communication
        elif wp.is_replicate() and xp.is_shard() and xp.dim == last:
            x_target[m] = Replicate()
    return tuple(x_target), tuple(w_target), decisions
