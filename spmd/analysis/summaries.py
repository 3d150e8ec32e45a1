"""What the search needs of each spec's plan: its collectives and memory, summarised from `explain` dry runs
of 1- and 2-block copies of the model (exact for identical blocks), cached, optionally in worker processes."""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..layout.annotate import fake_copy, infer_axes
from ..layout.blocks import find_blocks
from ..layout.rules import Rules
from .explain import explain

__all__ = ["Summary", "summarize", "plan_summary", "plan_all", "model_state_bytes", "frozen", "as_model"]

PARAM_REASONS = ("gather ", "regather ", "reduce gradient ")


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
    groups: dict   # (axis, "param" | "activation") -> [count, bytes]
    memory: dict

    def __sub__(self, o):
        keys = set(self.groups) | set(o.groups)
        return Summary({k: [a - b for a, b in zip(self.groups.get(k, [0, 0]), o.groups.get(k, [0, 0]))] for k in keys},
                        {k: self.memory[k] - o.memory[k] for k in self.memory})

    def __add__(self, o):
        keys = set(self.groups) | set(o.groups)
        return Summary({k: [a + b for a, b in zip(self.groups.get(k, [0, 0]), o.groups.get(k, [0, 0]))] for k in keys},
                        {k: self.memory[k] + o.memory[k] for k in self.memory})

    def __mul__(self, f: int):
        return Summary({k: [v * f for v in g] for k, g in self.groups.items()}, {k: v * f for k, v in self.memory.items()})


def summarize(plan) -> Summary:
    groups: dict = {}
    for c in plan.collectives:
        if c.kind == "recv":
            continue  # the matching send carries the bytes of a point-to-point exchange (the cp ring)
        traffic = "param" if c.reason.startswith(PARAM_REASONS) else "activation"
        g = groups.setdefault(("+".join(c.axes), traffic), [0, 0])
        g[0] += 1
        g[1] += c.bytes
    return Summary(groups, dict(plan.memory))


def model_state_bytes(model: nn.Module, sizes: dict, rules: Rules, optimizer_states: int = 2) -> int:
    """Parameters + gradients + optimizer states per rank from the annotations and the params map alone
    (no dry run): the floor under a spec's memory, used to drop hopeless specs before planning them.
    Parameters pinned by the user count as sharded over the whole mesh (a floor stays a floor)."""
    axes = infer_axes(model)
    world = math.prod(sizes.values())
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name in axes:
            dims = rules.mesh_axes(axes[name], "params", f"parameter {name!r}")
            shards = math.prod(sizes.get(a, 1) for d in dims for a in d)
        else:
            shards = world
        total += p.numel() // shards * p.element_size()
    return total * (2 + optimizer_states)


_cache: dict = {}


def _cache_key(model, sizes, sp, batch_shape, dtype, rules):
    cfg = getattr(model, "cfg", None)
    who = repr(cfg) if cfg is not None else id(model)  # a config names the model; else this object (kept alive)
    return (who, frozen(dict(sizes)), sp, tuple(batch_shape), str(dtype), repr(rules))


def plan_summary(model: nn.Module, sizes: dict, sp: bool, batch_shape, dtype, rules=None) -> Summary:
    """The plan of the full model, from dry runs of 1- and 2-block copies (exact for identical blocks)."""
    sizes = dict(sizes)
    rules = rules or Rules.default(sequence_parallel=sp)
    key = _cache_key(model, sizes, sp, batch_shape, dtype, rules)
    if key in _cache:
        return _cache[key][1]
    try:
        name, blocks = find_blocks(model)
    except ValueError:
        name, blocks = None, []
    if name is None or len(blocks) <= 2:
        out = summarize(explain(model, rules, sizes, batch_shape=batch_shape, dtype=dtype))
    else:
        one = summarize(explain(_truncated(model, name, 1), rules, sizes, batch_shape=batch_shape, dtype=dtype))
        two = summarize(explain(_truncated(model, name, 2), rules, sizes, batch_shape=batch_shape, dtype=dtype))
        out = one + (two - one) * (len(blocks) - 1)
    _cache[key] = (model if getattr(model, "cfg", None) is None else None, out)
    return out


_worker_model = None


def _first_line(e: Exception) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _worker_init(model_or_cfg):
    global _worker_model
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _worker_model = as_model(model_or_cfg)


def _plan_or_error(job):
    sizes, sp, batch_shape, dtype = job
    try:
        return job, plan_summary(_worker_model, sizes, sp, batch_shape, dtype)
    except (ValueError, RuntimeError) as e:
        return job, ValueError(_first_line(e))


def plan_all(net: nn.Module, model_arg, jobs: list, workers: int) -> dict:
    """{job: Summary or ValueError}, planned in this process or in `workers` spawned processes."""
    todo = [j for j in jobs if _cache_key(net, j[0], j[1], j[2], j[3], Rules.default(j[1])) not in _cache]
    results = {}
    if workers > 1 and len(todo) > 1:
        import multiprocessing
        payload = model_arg if not isinstance(model_arg, nn.Module) else fake_copy(model_arg, None)
        with multiprocessing.get_context("spawn").Pool(min(workers, len(todo)), _worker_init, (payload,)) as pool:
            for job, out in pool.imap_unordered(_plan_or_error, todo):
                results[job] = out
                if isinstance(out, Summary):
                    key = _cache_key(net, job[0], job[1], job[2], job[3], Rules.default(job[1]))
                    _cache[key] = (net if getattr(net, "cfg", None) is None else None, out)
    for job in jobs:
        if job not in results:
            try:
                results[job] = plan_summary(net, *job)
            except (ValueError, RuntimeError) as e:  # a layout that does not divide (DTensor says RuntimeError)
                results[job] = ValueError(_first_line(e))
    return results
