"""What the search needs of each spec's plan: its collectives (per mesh axis and traffic class) and memory,
summarised from `explain` dry runs of 1- and 2-block copies of the model (exact for identical blocks), cached
(search_pool runs them, optionally in worker processes).

Activation checkpointing: `none` and `full` are planned as they are; `selective:N` (every N-th block
checkpointed) is composed from the blocks of those two plans: the first block checkpointed plus k-1 more
(k = ceil(L/N)) and L-k plain ones. With any checkpointing, backward rebuilds one block's activations at a
time: memory gets `recompute`, the activations of one plain block (a transient explain's count of saved
tensors leaves out)."""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..layout.annotate import infer_axes
from ..layout.blocks import find_blocks
from ..layout.rules import Rules
from ..runtime.transforms.checkpointing import parse_mode
from .explain import explain
from .record import ring_steps

__all__ = [
    "Summary",
    "summarize",
    "plan_summary",
    "planned",
    "checkpointed",
    "accumulated",
    "model_state_bytes",
    "frozen",
    "as_model",
    "rules_for",
    "TRAFFIC",
    "traffic",
    "ONE_BLOCK",
    "DRY_RUNS",
]

# how a collective's time is spent: "gather" parameters (critical path), "prefetch-forward"/"prefetch-backward"
# (a block's gather issued while the block before computes, spmd.runtime.parameters.group), "reduce" gradients and
# "update" (ZeRO 1/2's all-gather of the updated parameters after the step, critical path), both once per step
# under gradient accumulation, "activation" (tensor/sequence-parallel moves, losses)
TRAFFIC = ("activation", "gather", "prefetch-forward", "prefetch-backward", "reduce", "update")
ONCE_PER_STEP = ("reduce", "update")
EMPTY_GROUP = (0, 0, 0)  # a Summary group no collective falls in: count, bytes, ring steps
REDUCE_REASONS = ("reduce gradient ", "reduce-scatter gradients ", "all-reduce gradients ")
GATHER_REASONS = ("gather ", "regather ")


def traffic(c) -> str:
    """The TRAFFIC class of a recorded collective, from the reason the runtime tagged it with."""
    if c.reason.startswith(REDUCE_REASONS):
        return "reduce"
    if c.reason.startswith("all-gather updated "):
        return "update"
    if c.reason.startswith(GATHER_REASONS):
        return f"prefetch-{c.phase}" if ", prefetched" in c.reason else "gather"
    return "activation"


def frozen(sizes: dict) -> tuple:
    return tuple(sorted(sizes.items()))


def as_model(model_or_cfg) -> nn.Module:
    """The module itself, or a model config's `build()` on the meta device."""
    if isinstance(model_or_cfg, nn.Module):
        return model_or_cfg
    if hasattr(model_or_cfg, "build"):
        with torch.device("meta"):
            return model_or_cfg.build()
    raise TypeError(f"search takes an nn.Module or a model config with build(), got {type(model_or_cfg).__name__}")


def _truncated(model: nn.Module, name: str, k: int) -> nn.Module:
    """A shallow copy of `model` whose block list keeps its first k blocks (the blocks are shared, not copied)."""
    parent_name, _, attr = name.rpartition(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    if parent_name:
        for part in parent_name.split("."):
            child = copy.copy(parent._modules[part])
            child._modules = dict(child._modules)
            parent._modules[part] = child
            parent = child
    parent._modules[attr] = nn.ModuleList(list(model.get_submodule(name))[:k])
    return root


@dataclass
class Summary:
    """What the ranking needs from a plan: collective count and bytes per (axis, traffic class), memory."""

    groups: dict  # (axes, TRAFFIC class, collective kind) -> [count, bytes, ring steps] (record.ring_steps)
    memory: dict
    block: Summary | None = None  # one repeated block's share of the plan
    blocks: int = 0  # how many repeated blocks the model has

    def __sub__(self, o):
        return self._combine(o, operator.sub)

    def __add__(self, o):
        return self._combine(o, operator.add)

    def _combine(self, o, op) -> Summary:
        """Groups and memory combined entry by entry (a group one side lacks counts as EMPTY_GROUP)."""
        keys = set(self.groups) | set(o.groups)
        groups = {
            k: [op(a, b) for a, b in zip(self.groups.get(k, EMPTY_GROUP), o.groups.get(k, EMPTY_GROUP))] for k in keys
        }
        return Summary(groups, {k: op(self.memory[k], o.memory[k]) for k in self.memory})

    def __mul__(self, f: int):
        return Summary(
            {k: [v * f for v in g] for k, g in self.groups.items()}, {k: v * f for k, v in self.memory.items()}
        )


def summarize(plan) -> Summary:
    groups: dict = {}
    for c in plan.collectives:
        if c.kind == "recv":
            continue  # the matching send carries the bytes of a point-to-point exchange (the cp ring)
        g = groups.setdefault(("+".join(c.axes), traffic(c), c.kind), list(EMPTY_GROUP))
        g[0] += 1
        g[1] += c.bytes
        g[2] += ring_steps(c.kind, math.prod(plan.mesh.get(a, 1) for a in c.axes))
    # the peak is the whole step's moment, not a sum of parts: it does not scale with blocks or add a recompute
    return Summary(groups, {k: v for k, v in plan.memory.items() if k != "peak"})


def model_state_bytes(model: nn.Module, sizes: dict, rules: Rules, optimizer_states: int = 2) -> int:
    """Parameters + gradients + optimizer states per rank from the annotations and the rules' params, grads
    and optimizer maps alone (no dry run): the floor under a spec's memory, used to drop hopeless specs
    before planning them. Parameters pinned by the user count as sharded over the whole mesh (a floor stays
    a floor)."""
    axes = infer_axes(model)
    world = math.prod(sizes.values())
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        for which, copies in (("params", 1), ("grads", 1), ("optimizer", optimizer_states)):
            if name in axes:
                dims = rules.mesh_axes(axes[name], which, f"parameter {name!r}")
                shards = math.prod(sizes.get(a, 1) for d in dims for a in d)
            else:
                shards = world
            total += copies * (p.numel() // shards) * p.element_size()
    return total


def rules_for(sp: bool, zero: int | None) -> Rules:
    """The default rules of a searched candidate: sequence parallel or not, at ZeRO stage `zero` (None: a
    mesh without fsdp, where the stage changes nothing; the default, 3)."""
    return Rules.default(sequence_parallel=sp, zero=3 if zero is None else zero)


_cache: dict = {}
DRY_RUNS = [0]  # explain dry runs `planned` made in this process (the search reports how many)
ONE_BLOCK = "1-block copy"  # planned(block=ONE_BLOCK): the plan of the model cut to its first block


def _cache_key(model, sizes, sp, batch_shape, dtype, rules, ac="none"):
    cfg = getattr(model, "cfg", None)
    who = repr(cfg) if cfg is not None else id(model)  # a config names the model; else this object (kept alive)
    return (who, frozen(dict(sizes)), sp, tuple(batch_shape), str(dtype), repr(rules), ac)


def plan_summary(model: nn.Module, sizes: dict, sp: bool, batch_shape, dtype, rules=None, ac="none") -> Summary:
    """The plan of the full model under activation checkpointing `ac`, from dry runs of 1- and 2-block copies
    (exact for identical blocks); see the module docstring for `selective:N` and `recompute`."""
    rules = rules or Rules.default(sequence_parallel=sp)
    if not parse_mode(ac):
        return planned(model, sizes, sp, batch_shape, dtype, rules, "none")
    none = planned(model, sizes, sp, batch_shape, dtype, rules, "none", block=True)
    return checkpointed(none, planned(model, sizes, sp, batch_shape, dtype, rules, "full", block=True), ac)


def checkpointed(none: Summary, full: Summary, ac: str) -> Summary:
    """The plan under `ac` composed from the plans without and with every block checkpointed."""
    every = parse_mode(ac)
    if not every:
        return none
    if none.block is None:  # one block: backward rebuilds what checkpointing did not save
        return _with_recompute(full, none.memory["activations"] - full.memory["activations"])
    n, k = none.blocks, math.ceil(none.blocks / every)  # blocks 0, N, 2N, ... are checkpointed
    out = full + (none.block - full.block) * (n - k)
    # a plain block's regather is prefetched only by a plain block after it: move the others to "gather"
    plain = [i % every != 0 for i in range(n)]
    lone = (n - k) - sum(plain[j] and plain[j + 1] for j in range(n - 1))
    for (axes, cls, kind), one_block in none.block.groups.items():
        if cls == "prefetch-backward" and lone:
            key = (axes, cls, kind)
            out.groups[key] = [a - lone * b for a, b in zip(out.groups[key], one_block)]
            was = out.groups.get((axes, "gather", kind), EMPTY_GROUP)
            out.groups[(axes, "gather", kind)] = [a + lone * b for a, b in zip(was, one_block)]
    return _with_recompute(out, none.block.memory["activations"])


def accumulated(s: Summary, passes: int, grad_accum: int) -> Summary:
    """The plan of `passes` micro-batches (explain's grad_accum) as that of `grad_accum` ones: every collective
    but the gradient reductions and the after-step gathers repeats per micro-batch, those run once; memory is the
    same (one micro-batch's activations, the gradients held unreduced between micro-batches)."""
    groups = {
        k: list(v) if k[1] in ONCE_PER_STEP else [x * grad_accum // passes for x in v] for k, v in s.groups.items()
    }
    return Summary(groups, dict(s.memory))


def _with_recompute(s: Summary, nbytes: int) -> Summary:
    memory = {k: v for k, v in s.memory.items() if k != "total"}
    memory["recompute"] = nbytes
    return Summary(s.groups, {**memory, "total": sum(memory.values())})


def planned(
    model: nn.Module,
    sizes: dict,
    sp: bool,
    batch_shape,
    dtype,
    rules,
    ac: str,
    grad_accum: int = 1,
    block: bool = False,
) -> Summary:
    """The plan of the full model with `ac` none or full and `grad_accum` as explain gives it (cached); `.block`
    is one block's share (None for a model of fewer than 2 blocks, and for one of 2 unless `block`: the model
    is its own 2-block copy, one dry run). `block=ONE_BLOCK`: the plan of the 1-block copy alone (one dry run;
    spmd/analysis/derived.py makes full checkpointing's plan from it)."""
    sizes = dict(sizes)
    name, blocks = _blocks(model)
    block = block or len(blocks) > 2
    key = _cache_key(model, sizes, sp, batch_shape, dtype, rules, (ac, grad_accum, block))
    if key in _cache:
        return _cache[key][1]

    def run(m):
        DRY_RUNS[0] += 1
        return summarize(explain(m, rules, sizes, batch_shape=batch_shape, dtype=dtype, ac=ac, grad_accum=grad_accum))

    if block == ONE_BLOCK:
        out = run(_truncated(model, name, 1) if blocks else model)
    elif len(blocks) < 2 or not block:
        out = run(model)
    else:
        one, two = run(_truncated(model, name, 1)), run(_truncated(model, name, 2))
        out = one + (two - one) * (len(blocks) - 1)
        out.block, out.blocks = two - one, len(blocks)
    _cache[key] = (model if getattr(model, "cfg", None) is None else None, out)
    return out


def _blocks(model: nn.Module) -> tuple:
    try:
        return find_blocks(model)
    except ValueError:
        return None, []
