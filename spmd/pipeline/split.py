"""`split_stages(model, n_stages)`: cuts a model's repeated blocks into pipeline stages of balanced cost.

The model's block list (`find_blocks`: the largest nn.ModuleList of identical blocks, or the one named)
is cut into `n_stages` contiguous runs of at least one block each, so that the most expensive stage costs
as little as possible (an exact min-max partition by dynamic programming; among the optimal cuts, the one
with the most even stage costs). Everything that runs before the first block (the embedding) counts
towards the first stage, everything after the last block (final norm, output head, loss) towards the last.

Cost is `"flops"` (forward+backward FLOPs, counted by a forward of fake tensors under FlopCounterMode) or
`"params"`. Stages are placed on pipeline ranks round-robin (`style="loop"`: stage s on rank s % pp, what
torch's interleaved schedules expect) or in a V (`style="v"`, two stages per rank: rank r holds stages r
and 2pp-1-r, what ZBV expects).
"""

from dataclasses import asdict, dataclass, field

import torch.nn as nn

from ..layout.blocks import find_blocks
from .costs import stage_flops

__all__ = [
    "COSTS",
    "StageInfo",
    "StageSplit",
    "split_stages",
    "min_max_partition",
    "stage_ranks",
    "outside_blocks",
]

COSTS = ("flops", "params")


@dataclass
class StageInfo:
    index: int
    rank: int
    blocks: list  # indices into the block list
    params: int  # parameters held by the stage (embedding on the first, head on the last)
    flops: int  # forward+backward FLOPs for the example input (0 when not counted)
    first: bool
    last: bool

    def to_dict(self):
        return asdict(self)


@dataclass
class StageSplit:
    block_path: str  # qualified name of the block list, e.g. "layers"
    n_blocks: int
    pp: int  # pipeline ranks
    style: str  # "loop" | "v"
    cost: str  # what was balanced: "flops" | "params"
    stages: list = field(default_factory=list)  # list[StageInfo]
    pre: list = field(default_factory=list)  # names of modules before the blocks (first stage)
    post: list = field(default_factory=list)  # names of modules after the blocks (last stage)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def virtual_stages(self) -> int:
        return self.n_stages // self.pp

    def stages_of_rank(self, rank: int) -> list:
        return [s for s in self.stages if s.rank == rank]

    def imbalance(self, by: str | None = None) -> float:
        """Largest stage cost over the mean (1.0 is perfectly balanced)."""
        values = [getattr(s, by or self.cost) for s in self.stages]
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["imbalance"] = self.imbalance()
        return d

    def describe(self) -> str:
        lines = [
            f"{self.n_stages} stages over {self.pp} pipeline ranks ({self.style}), balanced by {self.cost}; "
            f"imbalance max/mean {self.imbalance():.3f}"
        ]
        for s in self.stages:
            extra = (" +" + ",".join(self.pre) if s.first and self.pre else "") + (
                " +" + ",".join(self.post) if s.last and self.post else ""
            )
            lines.append(
                f"  stage {s.index} on pp rank {s.rank}: {self.block_path}[{s.blocks[0]}:{s.blocks[-1] + 1}]"
                f"{extra}  params {s.params:,}  FLOPs {s.flops:,}"
            )
        return "\n".join(lines)


def stage_ranks(n_stages: int, pp: int, style: str = "loop") -> list[int]:
    """Pipeline rank of each stage."""
    if style == "v":
        if n_stages != 2 * pp:
            raise ValueError(
                f"a V-shaped schedule places exactly 2 stages on each rank: needs {2 * pp} stages "
                f"for pp={pp}, got {n_stages} (use virtual_stages=2)"
            )
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    if style != "loop":
        raise ValueError(f"stage placement style must be 'loop' or 'v', got {style!r}")
    return [s % pp for s in range(n_stages)]


def min_max_partition(costs: list, n_parts: int, first_extra=0, last_extra=0) -> list[list[int]]:
    """Contiguous runs of at least one item each, minimizing the largest run cost (first_extra is added to
    the first run, last_extra to the last); ties broken towards the smallest sum of squared run costs."""
    n = len(costs)
    if n_parts < 1:
        raise ValueError(f"need at least one stage, got {n_parts}")
    if n_parts > n:
        raise ValueError(
            f"cannot cut {n} blocks into {n_parts} stages: each stage needs at least one block "
            f"(use fewer stages, fewer virtual stages, or a deeper model)"
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run_cost(k, j, i):  # run k covers items j..i-1
        return prefix[i] - prefix[j] + (first_extra if k == 0 else 0) + (last_extra if k == n_parts - 1 else 0)

    inf = float("inf")
    # pass 1: the optimal largest run cost
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0
    for k in range(n_parts):
        for i in range(k + 1, n - (n_parts - k - 1) + 1):
            best[k + 1][i] = min(max(best[k][j], run_cost(k, j, i)) for j in range(k, i) if best[k][j] < inf)
    bound = best[n_parts][n]
    # pass 2: among cuts within that bound, the most even one
    sq = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    arg = [[-1] * (n + 1) for _ in range(n_parts + 1)]
    sq[0][0] = 0
    for k in range(n_parts):
        for i in range(k + 1, n - (n_parts - k - 1) + 1):
            for j in range(k, i):
                c = run_cost(k, j, i)
                if sq[k][j] < inf and c <= bound and sq[k][j] + c * c < sq[k + 1][i]:
                    sq[k + 1][i], arg[k + 1][i] = sq[k][j] + c * c, j
    runs, i = [], n
    for k in range(n_parts, 0, -1):
        j = arg[k][i]
        runs.append(list(range(j, i)))
        i = j
    return runs[::-1]


def _own_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _block_list(model: nn.Module, blocks: str | None, n_stages: int):
    try:
        path, block_list = find_blocks(model, blocks)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"cannot split {type(model).__name__} into pipeline stages: {e}") from None
    if len({type(b) for b in block_list}) != 1:
        raise ValueError(
            f"cannot split {type(model).__name__}: {path!r} holds blocks of different types "
            f"{sorted({type(b).__name__ for b in block_list})}; name a list of identical blocks"
        )
    n = len(block_list)
    if n_stages > n:
        raise ValueError(
            f"cannot split {type(model).__name__} into {n_stages} stages: it has {n} blocks in "
            f"{path!r} and each stage needs at least one (use fewer stages or virtual stages)"
        )
    return path, block_list


def outside_blocks(model: nn.Module, block_list) -> tuple[list, list, int, int]:
    """(pre, post, pre_params, post_params): the modules with parameters outside the blocks, by position
    (registered before the blocks -> first stage, after -> last)."""
    inside = {id(m) for m in block_list.modules()}
    pre, post, pre_params, post_params, seen_blocks = [], [], 0, 0, False
    for name, m in model.named_modules():
        if m is block_list:
            seen_blocks = True
            continue
        if id(m) in inside or not _own_params(m):
            continue
        if seen_blocks:
            post.append(name)
            post_params += _own_params(m)
        else:
            pre.append(name)
            pre_params += _own_params(m)
    return pre, post, pre_params, post_params


def split_stages(
    model: nn.Module,
    n_stages: int,
    cost: str = "flops",
    blocks: str | None = None,
    *,
    pp: int | None = None,
    style: str = "loop",
    example_inputs=None,
) -> StageSplit:
    """Cuts the model's block list into `n_stages` stages (see the module docstring).

    `pp`: pipeline ranks (default `n_stages`; `n_stages = pp * virtual_stages`). `blocks`: the qualified
    name of the block list when it is not the largest ModuleList of identical modules. `example_inputs`:
    a tuple of model inputs for counting FLOPs (default: one sequence of token ids of the model's
    `cfg.max_seq_len`, at most 2048).
    """
    if cost not in COSTS:
        raise ValueError(f"split cost must be one of {COSTS}, got {cost!r}")
    pp = pp or n_stages
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not divide evenly over {pp} pipeline ranks")
    ranks = stage_ranks(n_stages, pp, style)
    path, block_list = _block_list(model, blocks, n_stages)
    n = len(block_list)
    block_params = [sum(p.numel() for p in b.parameters()) for b in block_list]
    pre, post, pre_params, post_params = outside_blocks(model, block_list)
    flops_pre = flops_post = 0
    block_flops = [0] * n
    counted = stage_flops(model, block_list, cost, example_inputs)
    if counted is not None:
        flops_pre, block_flops, flops_post, order = counted
        ran_after = {name for name, after in order if after}
        moved = [name for name in pre if name in ran_after]  # registered early but run after the blocks
        for name in moved:
            pre.remove(name)
            post.append(name)
            k = _own_params(model.get_submodule(name))
            pre_params, post_params = pre_params - k, post_params + k
        flops_pre, block_flops, flops_post = 3 * flops_pre, [3 * f for f in block_flops], 3 * flops_post

    if cost == "flops":
        runs = min_max_partition(block_flops, n_stages, flops_pre, flops_post)
    else:
        runs = min_max_partition(block_params, n_stages, pre_params, post_params)
    split = StageSplit(block_path=path, n_blocks=n, pp=pp, style=style, cost=cost, pre=pre, post=post)
    for s, run in enumerate(runs):
        first, last = s == 0, s == n_stages - 1
        split.stages.append(
            StageInfo(
                index=s,
                rank=ranks[s],
                blocks=run,
                first=first,
                last=last,
                params=sum(block_params[i] for i in run) + (pre_params if first else 0) + (post_params if last else 0),
                flops=sum(block_flops[i] for i in run) + (flops_pre if first else 0) + (flops_post if last else 0),
            )
        )
    return split
