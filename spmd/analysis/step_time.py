"""The search's step-time model: compute, recompute, each collective on its link, and the part of the
parameter traffic the runtime hides behind compute.

    compute    = FLOPs per rank / (peak FLOP/s x efficiency), FLOPs per token as the model's config counts
                 them (Llama: 6 N_non_embedding + 12 L H Q T), the same for every spec; a third of it is the
                 forward, two thirds the backward;
    recompute  = activation checkpointing runs the forward of the checkpointed blocks again in backward:
                 `full` adds one forward (compute / 3), `selective:N` its fraction ceil(L/N)/L of one;
    collective = latency + ring steps x step latency + bytes / bandwidth of its link (devices.py): within a
                 node (NVLink) when the ranks of its mesh axis sit in one node (tp is innermost, then fsdp,
                 then dp), else across nodes (InfiniBand); an all-reduce over n ranks is 2(n-1) steps; a
                 device with figures per collective kind (Device.kind_links: the CPU's, fitted to
                 collectives timed inside real steps) prices each kind with its own;
    micro-batches (gradient accumulation, K): every collective of a micro-batch runs K times, except the
                 gradient reductions, which run once (spmd.no_sync holds them back; summaries.accumulated);
    overlap    = what spmd.runtime.parameters.group overlaps: a block's parameter gather issued while the block before
                 computes (FSDP2's prefetch; in backward the regather of the block before, when it is not
                 checkpointed). Prefetched gathers hide behind the compute of their phase, at most all of
                 it, on a device whose collectives progress while it computes (Device.overlaps_comm); the
                 first block's gather, the regathers of recomputed blocks, gradient reductions (waited for
                 where they are issued) and tensor/sequence-parallel moves are on the critical path;
    step       = compute + recompute + every collective - hidden.
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..layout.mesh import MESH_AXES
from ..runtime.transforms.checkpointing import parse_mode
from .devices import Device
from .summaries import TRAFFIC, Summary

__all__ = ["links", "flops_per_token", "recompute_fraction", "predict"]


def links(sizes: dict, per_node: int) -> dict:
    """'intra' or 'inter' per mesh axis of size > 1: an axis' ranks are `stride` apart (tp innermost)."""
    out, stride = {}, 1
    world = math.prod(sizes.values())
    for axis in reversed(MESH_AXES):
        size = sizes.get(axis, 1)
        if size > 1:
            out[axis] = "intra" if world <= per_node or stride * size <= per_node else "inter"
        stride *= size
    return dict(reversed(list(out.items())))


def flops_per_token(model: nn.Module, seq: int) -> float:
    """The model config's own count (`cfg.flops_per_token(seq)`) where it has one, else 6 N_non_embedding."""
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "flops_per_token"):
        return cfg.flops_per_token(seq)
    emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return 6 * sum(p.numel() for p in model.parameters() if id(p) not in emb)


def recompute_fraction(ac: str, n_blocks: int) -> float:
    """The fraction of one forward that checkpointing `ac` runs again: the share of blocks checkpointed."""
    every = parse_mode(ac)
    return 0.0 if not every or not n_blocks else math.ceil(n_blocks / every) / n_blocks


def predict(summary: Summary, sizes: dict, dev: Device, compute_s: float, recompute_s: float = 0.0) -> dict:
    """Step time of `summary` (the plan of a whole step, every micro-batch) on `dev`, per the module docstring."""
    link = links(sizes, dev.per_node)
    t = dict.fromkeys(TRAFFIC, 0.0)
    for (axes, cls, kind), (count, nbytes, steps) in summary.groups.items():
        fig = dev.link(kind, inter=any(link.get(a) == "inter" for a in axes.split("+")))
        t[cls] += count * fig.latency + steps * fig.step_latency + nbytes / fig.bandwidth
    forward_s = compute_s / 3
    hidden = (
        0.0
        if not dev.overlaps_comm
        else (min(t["prefetch-forward"], forward_s) + min(t["prefetch-backward"], compute_s - forward_s + recompute_s))
    )
    param = t["gather"] + t["prefetch-forward"] + t["prefetch-backward"] + t["reduce"] + t["update"]
    return {
        "activation_comm_s": t["activation"],
        "param_comm_s": param,
        "hidden_s": hidden,
        "step_s": compute_s + recompute_s + t["activation"] + param - hidden,
        "links": link,
    }
