"""What makes the search's dry runs cheap changes no plan: DTensor's transform plans kept across dry runs
(spmd/analysis/fake.py) give explain's plan as torch's own planner does."""

import contextlib

import torch

import spmd
from models.llama import Llama, LlamaConfig
from spmd.analysis import fake


def _plan(model, sizes, batch_shape):
    plan = spmd.explain(model, spmd.Rules.default(True), sizes, batch_shape=batch_shape, ac="none")
    return [(c.kind, c.axes, c.bytes, c.phase, c.reason) for c in plan.collectives], plan.memory


def test_kept_transform_plans_give_torchs_plan(monkeypatch):
    """With sequence parallelism (activations move between sequence- and feature-sharded layouts through
    DTensor's redistributions), explain with the kept plans, filled at one batch and then served from them at
    another, lists the same collectives (kind, axes, bytes, phase, reason) and memory as with torch's planner
    alone. Mutation it kills: the key without the target spec (`key = (src_spec, use_graph_based_transform,
    ...)` in spmd/analysis/fake.py)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", kernels="torch"))
    sizes = {"fsdp": 2, "tp": 2}
    fake._transform_plans.clear()
    kept = [_plan(model, sizes, (4, 32))]
    filled = len(fake._transform_plans)
    kept.append(_plan(model, sizes, (8, 32)))
    assert filled > 0 and len(fake._transform_plans) >= filled
    monkeypatch.setattr(fake, "_kept_transform_plans", contextlib.nullcontext)
    assert kept[1] == _plan(model, sizes, (8, 32))
