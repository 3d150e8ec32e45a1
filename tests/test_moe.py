"""The mixture-of-experts model (models/moe.py) under expert parallelism matches one process.

Four gloo processes on CPU, fp32, fixed seeds, AdamW, 3 steps, each spec against the same model trained in
one process: loss (cross-entropy plus the router losses), every gradient and every updated parameter within
1e-5 (relative norm, as tests/test_spmd_numerics.py measures). The router is made uneven on purpose: in
every layer router rows 1 and 3 are the negatives of rows 0 and 2 and row 7 is zero, so at least two
logits are >= expert 7's and expert 7 gets no token in the first step; the other experts get unequal
counts. The distributed run's tokens per expert equal the one-process run's in every step.
"""
import pytest
import torch

import models
import spmd
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, norm_rel_err

TOL = 1e-5
SPECS = ["ep=4", "fsdp=2,ep=2", "ep=2,tp=2"]


def moe_tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = models.preset("moe-tiny", kernels="torch").build()
    with torch.no_grad():
        for layer in model.layers:
            w = layer.feed_forward.router.weight
            w[1], w[3], w[7] = -w[0], -w[2], 0.0
    return model


def _data_slice(t, mesh, rules):
    n, r = rules.data_parallel_size(mesh), rules.data_parallel_rank(mesh)
    b = t.shape[0] // n
    return t[r * b:(r + 1) * b]


def _reference(steps: int = 3) -> list[dict]:
    """One process's trajectory: per step the loss, tokens per expert, gradients and updated parameters."""
    ref = moe_tiny()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    out = []
    for step in range(steps):
        loss = ref(*global_batch(step))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step(); opt.zero_grad()
        out.append(dict(loss=loss.item(), counts=ref.router_stats()["tokens_per_expert"], grads=grads,
                        params={n: p.detach().clone() for n, p in ref.named_parameters()}))
    return out


def _train_and_compare(spec, reference):
    mesh = spmd.make_mesh(spmd.parse_spec(spec)[0])
    rules = spmd.Rules.default()
    model = spmd.parallelize(moe_tiny(), mesh, rules)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step, ref in enumerate(reference):
        tokens, targets = global_batch(step)
        loss = model(_data_slice(tokens, mesh, rules), _data_slice(targets, mesh, rules))
        assert abs(loss.item() - ref["loss"]) <= TOL * abs(ref["loss"]), (spec, step, loss, ref["loss"])
        counts = model.router_stats()["tokens_per_expert"].full_tensor()
        assert torch.equal(counts, ref["counts"]), (spec, step, counts, ref["counts"])
        if step == 0:
            assert (counts == 0).any() and counts.max() > 2 * counts[counts > 0].min(), counts
        loss.backward()
        for name, p in model.named_parameters():
            err = norm_rel_err(p.grad.full_tensor(), ref["grads"][name])
            assert err <= TOL, f"{spec} step {step}: gradient of {name} off by {err:.2e}"
        opt.step(); opt.zero_grad()
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref["params"][name])
            assert err <= TOL, f"{spec} step {step}: parameter {name} off by {err:.2e}"


def _all_specs(rank, world):
    reference = _reference()
    for spec in SPECS:
        _train_and_compare(spec, reference)


@pytest.mark.slow
def test_expert_parallel_matches_one_process():
    run_distributed(_all_specs, 4, timeout_s=300)
