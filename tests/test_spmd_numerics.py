"""Every spec trains the tiny model like one device does: losses, gradients, the clipped global gradient
norm and updated parameters.

Four gloo processes on CPU, fp32, fixed seeds, AdamW with clipping at norm 0.5, 2 steps (the second's gradients,
taken at the updated parameters, and its update, reading Adam's stored moments, prove what a third did), compared
with the same model trained in one process. Tolerance 1e-5 relative: sharded matmuls and reductions sum in a
different order than one device does, which moves fp32 results by ~1e-7; anything structural (a missing
reduction, a wrong slice) is off by orders of magnitude more. Errors are ||a-b|| / ||b|| per tensor: Adam divides each
gradient element by its own magnitude, so an element near zero turns a 1e-7 summation difference into a
visible change of that one element, which a max-norm would report as if the whole tensor were off.

The same processes measure memory against `spmd.explain`'s plan for the spec, made beforehand on a fake
world: after the first real AdamW step, the bytes of the local shards of every parameter, gradient and
AdamW moment equal the plan's exactly; the bytes autograd keeps for backward (tests/measured.py) in the
first step are within ACT_TOL of the plan's activations, and so are they with full and every-second-block
activation checkpointing on AC_SPECS (ZeRO-3's regather handles, tensor and sequence parallel, both).
Kills explain's activation bytes 4% high (tests/mutants.py).
"""

import contextlib

import pytest
import torch

import spmd
from tests.dist_utils import run_distributed
from tests.measured import saved_bytes, state_bytes
from tests.spmd_cases import global_batch, local_slice, norm_rel_errs, plan_for, tiny_model

TOL = 1e-5
ACT_TOL = 0.01  # measured: at most +0.46% (fsdp=4, full checkpointing)
SPECS = ["dp=4", "fsdp=4", "dp=2,fsdp=2", "tp=4", "tp=4,sp", "fsdp=2,tp=2", "fsdp=2,tp=2,sp"]
AC_SPECS = ["fsdp=4", "tp=4,sp", "fsdp=2,tp=2,sp"]
AC_MODES = ["full", "selective:2"]


def _planned_memory(spec) -> dict:
    """{ac mode: explain's memory per rank} for the tiny model on a fake world of this spec."""
    return {ac: plan_for(spec, ac).memory for ac in ["none"] + (AC_MODES if spec in AC_SPECS else [])}


def _check_activations(spec, kept, want):
    err = abs(kept - want) / want
    assert err <= ACT_TOL, f"{spec}: autograd kept {kept:,} B for backward, the plan says {want:,} B"


def _checkpointed_activations(spec, mesh, rules, planned):
    tokens, targets = global_batch(0)
    for ac in AC_MODES:
        if ac in planned:
            model = spmd.parallelize(tiny_model(), mesh, rules)
            spmd.apply_activation_checkpointing(model, ac)
            with saved_bytes(model) as saved:
                loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
            loss.backward()
            _check_activations(f"{spec} ac={ac}", saved["activations"], planned[ac]["activations"])


def _train_and_compare(rank, world, spec, tied=False, planned=None):
    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    ref = tiny_model(tie_embeddings=tied)
    model = tiny_model(tie_embeddings=tied)
    rules = spmd.Rules.default(sequence_parallel="sp" in flags)
    spmd.parallelize(model, mesh, rules)
    if planned:
        _checkpointed_activations(spec, mesh, rules, planned)
    # fused, the trainer's AdamW: on DTensor parameters it updates the local shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        tokens, targets = global_batch(step)
        with saved_bytes(model) if planned else contextlib.nullcontext() as saved:
            loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
        if planned and step == 0:
            _check_activations(spec, saved["activations"], planned["none"]["activations"])
        ref_loss = ref(tokens, targets)
        assert not isinstance(loss, torch.distributed.tensor.DTensor)
        assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (spec, step, loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        for name, p in model.named_parameters():
            assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements, p.placements)
        grads = [(name, p.grad, ref_params[name].grad) for name, p in model.named_parameters()]
        for name, err in norm_rel_errs(grads).items():
            assert err <= TOL, f"{spec} step {step}: gradient of {name} off by {err:.2e}"
        # global-norm clipping over every mesh axis: the norm is the one-device norm, and it clips
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).full_tensor()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert ref_norm > 0.5 and abs(norm - ref_norm) <= TOL * ref_norm, (spec, step, norm, ref_norm)
        opt.step()
        ref_opt.step()
        if planned and step == 0:
            got, want = state_bytes(model, opt), planned["none"]
            assert got == {k: want[k] for k in got}, f"{spec}: measured {got}, plan {want}"
        opt.zero_grad()
        ref_opt.zero_grad()
        params = [(name, p, ref_params[name].detach()) for name, p in model.named_parameters()]
        for name, err in norm_rel_errs(params).items():
            assert err <= TOL, f"{spec} step {step}: parameter {name} off by {err:.2e}"


def _each_spec(rank, world, cases):
    for spec, tied, planned in cases:
        _train_and_compare(rank, world, spec, tied, planned)


@pytest.mark.slow
@pytest.mark.parametrize(
    "specs", [SPECS[:3], SPECS[3:]], ids=["data_axes", "tensor_parallel"]
)  # one launch per group: a process's later specs reuse DTensor's sharding rules decided for its first
def test_spec_matches_one_device_and_its_plan(specs):
    """Each spec of the group in turn, in one launch of 4 processes; with tensor parallelism also tied
    embeddings on fsdp=2,tp=2,sp (the embedding and output share one weight: gathered once per forward, its
    gradient reduced once)."""
    cases = [(spec, False, _planned_memory(spec)) for spec in specs]
    if "fsdp=2,tp=2,sp" in specs:
        cases.append(("fsdp=2,tp=2,sp", True, None))
    run_distributed(_each_spec, 4, cases, timeout_s=600)
