"""ZeRO stages as rule tables (`Rules.default(zero=k)` + `spmd.shard_optimizer`), on 4 gloo processes.

One launch trains the tiny model 3 AdamW steps (fp32, fixed seeds) per spec and stage and holds it against
one process: loss, every gradient, every updated parameter within TOL (relative norm, as in
tests/test_spmd_numerics.py). In the first step of each run it measures, on the real tensors and the real
collectives, what `spmd.explain` planned on a fake world beforehand: the bytes this rank holds of parameters,
gradients (reduced, before the step) and optimizer states (with any master copy), exactly; and the bytes
on the wire per phase and collective kind, exactly, which also equal the reference formulas with
Ψ' = 4Ψ(n-1)/n bytes (ring convention): data parallel (zero=0) all-reduce 2Ψ'; stage 1 all-reduce 2Ψ' and
the all-gather of updated shards Ψ' (it holds full gradients: "all-reduce, then keep the shard"); stage 2
reduce-scatter Ψ' + all-gather Ψ'; stage 3 all-gather Ψ' forward, the regather of every weight but the
embedding's backward, reduce-scatter Ψ' (0 and 3 as planned; real runs of them: test_spmd_numerics.py,
test_plan_matches_run.py). The same launch checks gradient accumulation under no_sync
(stage 2) and that a stage-1 checkpoint loads into stage 3.
"""
import collections

import pytest
import torch

import spmd
from spmd import checkpoint
from spmd.analysis.record import CollectiveRecorder
from tests.dist_utils import run_distributed
from tests.spmd_cases import BATCH, SEQ, global_batch, local_slice, norm_rel_err, tiny_model

TOL = 1e-5
RUNS = [("fsdp=4", 1), ("fsdp=4", 2), ("dp=2,fsdp=2", 1), ("dp=2,fsdp=2", 2), ("fsdp=2,tp=2,sp", 1),
        ("fsdp=2,tp=2,sp", 2)]  # stage 3 on these specs: tests/test_spmd_numerics.py, the default rules


def _rules(spec, zero):
    sizes, flags = spmd.parse_spec(spec)
    return sizes, spmd.Rules.default(sequence_parallel="sp" in flags, zero=zero)


def _plan(spec, zero):
    sizes, rules = _rules(spec, zero)
    plan = spmd.explain(tiny_model(), rules, sizes, batch_shape=(BATCH, SEQ))
    return plan.memory, _comm([c for c in plan.collectives if c.origin == "planned"])


def _comm(records) -> dict:
    out = collections.Counter()
    for c in records:
        out[(c.phase, c.kind)] += c.bytes
    return dict(out)


def _local_nbytes(t) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def _optimizer_bytes(model, opt) -> int:
    """AdamW's moments, plus each master that is a copy (a view of its parameter's shard costs nothing)."""
    total = 0
    for group in opt.param_groups:
        for m in group["params"]:
            total += sum(_local_nbytes(opt.state[m][k]) for k in ("exp_avg", "exp_avg_sq"))
            p = getattr(m, "_spmd_master_of", m)
            if m is not p and m._local_tensor.untyped_storage()._cdata != p._local_tensor.untyped_storage()._cdata:
                total += _local_nbytes(m)
    return total


def _train(spec, zero, planned, accumulate=False):
    sizes, rules = _rules(spec, zero)
    mesh = spmd.make_mesh(sizes)
    ref, model = tiny_model(), spmd.parallelize(tiny_model(), mesh, rules)
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    ref_params = dict(ref.named_parameters())
    for step in range(3):
        tokens, targets = global_batch(step)
        recorder = CollectiveRecorder(mesh)
        with recorder:
            loss = _forward_backward(model, local_slice(tokens, mesh), local_slice(targets, mesh), accumulate)
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) <= TOL * abs(ref_loss.item()), (spec, zero, step, loss, ref_loss)
        for name, p in model.named_parameters():
            assert tuple(p.grad.placements) == tuple(p._spmd_grads), (name, p.grad.placements, p._spmd_grads)
            err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
            assert err <= TOL, f"{spec} zero={zero} step {step}: gradient of {name} off by {err:.2e}"
        grads = sum(_local_nbytes(p.grad) for p in model.parameters())
        with recorder:
            opt.step()
        ref_opt.step()
        if step == 0 and planned is not None:
            memory, comm = planned
            got = {"parameters": sum(_local_nbytes(p) for p in model.parameters()), "gradients": grads,
                   "optimizer": _optimizer_bytes(model, opt)}
            assert got == {k: memory[k] for k in got}, f"{spec} zero={zero}: measured {got}, plan {memory}"
            measured = _comm([c for c in recorder.records if c.origin == "planned"])
            assert measured == comm, f"{spec} zero={zero}: measured {measured}, plan {comm}"
        opt.zero_grad(); ref_opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref_params[name].detach())
            assert err <= TOL, f"{spec} zero={zero} step {step}: parameter {name} off by {err:.2e}"
    return model, opt


def _forward_backward(model, tokens, targets, accumulate: bool) -> float:
    if not accumulate:
        loss = model(tokens, targets)
        loss.backward()
        return loss.item()
    half = tokens.shape[0] // 2
    with spmd.no_sync(model):
        first = model(tokens[:half], targets[:half]) / 2
        first.backward()
    second = model(tokens[half:], targets[half:]) / 2
    second.backward()
    return first.item() + second.item()


def _stage1_checkpoint_loads_into_stage3(model, opt, tmp):
    checkpoint.save(tmp, 3, checkpoint.model_state(model), checkpoint.optim_state(model, opt))
    sizes, rules = _rules("fsdp=4", 3)
    other = spmd.parallelize(tiny_model(seed=7), spmd.make_mesh(sizes), rules)
    other_opt = spmd.shard_optimizer(other, torch.optim.AdamW(other.parameters()))
    checkpoint.load(tmp, checkpoint.model_state(other), checkpoint.optim_state(other, other_opt, init=True))
    saved, loaded = checkpoint.optim_state(model, opt), checkpoint.optim_state(other, other_opt)
    for name, t in saved.items():
        assert torch.equal(loaded[name].full_tensor() if hasattr(loaded[name], "full_tensor") else loaded[name],
                           t.full_tensor() if hasattr(t, "full_tensor") else t), name
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


def _all_runs(rank, world, plans, tmp):
    for (spec, zero), planned in zip(RUNS, plans):
        model, opt = _train(spec, zero, planned)
        if (spec, zero) == ("fsdp=4", 1):
            _stage1_checkpoint_loads_into_stage3(model, opt, tmp)
    _train("dp=2,fsdp=2", 2, None, accumulate=True)


@pytest.mark.slow
def test_zero_stages_match_one_device_and_their_plans(tmp_path):
    plans = [_plan(spec, zero) for spec, zero in RUNS]
    by_stage = {zero: comm for (spec, zero), (_, comm) in zip(RUNS, plans) if spec == "fsdp=4"}
    by_stage.update({zero: _plan("fsdp=4", zero)[1] for zero in (0, 3)})
    psi = 4 * sum(p.numel() for p in tiny_model().parameters())
    ring = psi * 3 // 4
    embedding = 4 * tiny_model().tok_embeddings.weight.numel() * 3 // 4
    formulas = {0: {("backward", "all_reduce"): 2 * ring},
                1: {("backward", "all_reduce"): 2 * ring, ("optimizer", "all_gather"): ring},
                2: {("backward", "reduce_scatter"): ring, ("optimizer", "all_gather"): ring},
                3: {("forward", "all_gather"): ring, ("backward", "all_gather"): ring - embedding,
                    ("backward", "reduce_scatter"): ring}}
    for zero, comm in sorted(by_stage.items()):
        print(f"zero={zero}: planned {comm}, formula {formulas[zero]}, total/Ψ' {sum(comm.values()) / ring:.4f}")
        assert comm == formulas[zero], (zero, comm)
    run_distributed(_all_runs, 4, plans, str(tmp_path), timeout_s=300)
