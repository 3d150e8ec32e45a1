"""ZeRO stages as rule tables (`Rules.default(zero=k)` + `spmd.shard_optimizer`), on 4 gloo processes.

One launch trains the tiny model 3 AdamW steps (fp32, fixed seeds) per spec and stage and holds it against
one process: loss, every gradient, every updated parameter within TOL (relative norm, as in
tests/test_spmd_numerics.py). In the first step of each run it measures, on the real tensors and the real
collectives, what `spmd.explain` planned on a fake world beforehand: the bytes this rank holds of parameters,
gradients (reduced, before the step) and optimizer states (with any master copy), exactly; and the bytes
on the wire per phase and collective kind, exactly, which also equal the reference formulas with
Ψ' = 4Ψ(n-1)/n bytes (ring convention): data parallel (zero=0) all-reduce 2Ψ'; stage 1 2Ψ', all in the
step: backward leaves the gradients whole and unreduced, and spmd.reduce_gradients (before the step, where
the trainer clips) reduce-scatters them into the optimizer's shards (Ψ'), in flat buffers: one collective
per mesh axis, before the all-gather of updated shards (Ψ', one flat buffer); with two accumulated micro-batches
(dp=2,fsdp=2) that reduction still runs once per step, as planned; stage 2 reduce-scatter Ψ' in backward + all-gather
Ψ'; stage 3 all-gather Ψ' forward, the regather of every weight but the embedding's backward, reduce-scatter Ψ' (0 as
planned; real runs of it: test_plan_matches_run.py). With `offload="optimizer"` (stage 3 on fsdp=4, stage 1 on
fsdp=2,tp=2,sp, and stage 2 with no_sync accumulation on dp=2,fsdp=2) every master, its gradient and AdamW's moments are
copies in host memory (pinned when there is a CUDA device; on this CPU-only machine host memory is the device), the
plan's host bytes equal them, and the numbers equal one process the same. With bf16 parameters and reduction and the
fp32 master in the optimizer (`master="optimizer"`, stage 2), the bytes equal the plan's and 3 steps track
fp32 one-process training within BF16_TOL. With `offload="nvme:DIR"` (stage 2 on dp=2,fsdp=2) the masters
and moments are memory-mapped files under DIR that hold their values, counted by the plan as NVMe bytes,
and the numbers equal one process; on a wider model the step streams that state, one parameter's resident
at a time (tests/zero_offload.py). A stage-1 checkpoint loads into stage 3.
A rules table putting mlp's gradients on fsdp and tp, where tp already splits them, gives one process's gradients
(through DTensor), and shard_optimizer refuses it as an optimizer map on every rank. Mutations that fail it
(each tried): the flat groups' reduce-scatter taken onto that dim; the nesting check left per rank.
"""

import collections
import contextlib

import pytest
import torch

import spmd
from spmd import checkpoint
from tests.dist_utils import run_distributed
from tests.spmd_cases import BATCH, SEQ, global_batch, local_slice, norm_rel_err, tiny_model
from tests.zero_offload import GatherInputs, nvme_memory, nvme_streams_its_state, params_on_host, wide_reference

TOL = 1e-5
# bf16 parameters and gradients against fp32 one-process training: Adam normalises each gradient element, so
# bf16 gradient rounding moves small elements' updates; measured after 3 steps: at most 1.0e-2 (attention wo)
BF16_TOL = 2e-2
RUNS = [
    ("fsdp=4", 1, None),
    ("fsdp=4", 2, None),
    ("dp=2,fsdp=2", 1, None),
    ("dp=2,fsdp=2", 2, None),
    ("fsdp=2,tp=2,sp", 1, None),
    ("fsdp=2,tp=2,sp", 2, None),  # stage 3: test_spmd_numerics.py (default rules)
    ("fsdp=4", 3, "optimizer"),
    ("fsdp=2,tp=2,sp", 1, "optimizer"),
    ("dp=2,fsdp=2", 2, "nvme:"),
    ("fsdp=4", 3, "params"),
]
ACCUMULATE = {("dp=2,fsdp=2", 1, None)}  # two micro-batches: stage 1's backward moves nothing, the step reduces once


def _rules(spec, zero):
    sizes, flags = spmd.parse_spec(spec)
    return sizes, spmd.Rules.default(sequence_parallel="sp" in flags, zero=zero)


def _in(offload, tmp):
    return f"nvme:{tmp}/nvme" if offload == "nvme:" else offload


def _plan(spec, zero, offload=None):
    sizes, rules = _rules(spec, zero)
    plan = spmd.explain(tiny_model(), rules, sizes, batch_shape=(BATCH, SEQ), offload=offload)
    return plan.memory, _comm([c for c in plan.collectives if c.origin == "planned"])


def _comm(records) -> dict:
    out = collections.Counter()
    for c in records:
        out[(c.phase, c.kind)] += c.bytes
    return dict(out)


def _local_nbytes(t) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def _masters(opt):
    return [(getattr(m, "_spmd_master_of", m), m) for group in opt.param_groups for m in group["params"]]


def _storage(t) -> int:
    return t._local_tensor.untyped_storage()._cdata


def _measured_memory(model, opt, grads: int, offload) -> dict:
    """Bytes of the real tensors: AdamW's moments plus each master that is a copy (a view of its parameter's
    shard costs nothing); offloaded, those and the gradient shards copied out are host bytes, and each
    lives where it should: off the parameter's storage, in host memory, pinned when there is a CUDA device
    (under nvme:DIR, in files, streamed: tests/zero_offload.py)."""
    states = masters = grads_out = 0
    for p, m in _masters(opt):
        states += sum(_local_nbytes(opt.state[m][k]) for k in ("exp_avg", "exp_avg_sq"))
        masters += _local_nbytes(m) if m is not p and _storage(m) != _storage(p) else 0
        if offload == "optimizer":
            for t in (m, m.grad, opt.state[m]["exp_avg"], opt.state[m]["exp_avg_sq"]):
                assert t.device.type == "cpu" and t._local_tensor.is_pinned() == torch.cuda.is_available()
            assert _storage(m) != _storage(p) and _storage(m.grad) != _storage(p.grad if p.grad is not None else p)
            grads_out += _local_nbytes(m.grad)
        if offload and offload.startswith("nvme:"):
            _check_in_files(m, opt.state[m], offload[len("nvme:") :])
            assert m.grad is None and _storage(m) != _storage(p)  # the streamed step dropped its copy
    got = {
        "parameters": sum(_local_nbytes(p) for p in model.parameters()),
        "gradients": grads,
        "optimizer": 0 if offload else states + masters,
    }
    if offload == "params":
        got.update(params_on_host(model, opt, {**got, "optimizer": states + masters}))
    elif offload == "optimizer":
        got.update({"gradients_host": grads_out, "optimizer_host": states + masters})
    elif offload:
        got.update(nvme_memory(opt, offload[len("nvme:") :]))
    return got


def _check_in_files(master, state, directory):
    """The master and both moments are memory-mapped files under `directory` holding their values."""
    for key, t in (("master", master), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
        local = t._local_tensor
        path = local.untyped_storage().filename
        assert path is not None and path.startswith(directory) and path.endswith(f"{master._spmd_name}.{key}"), path
        on_disk = torch.from_file(path, shared=False, size=local.numel(), dtype=local.dtype)
        assert torch.equal(on_disk.view(local.shape), local.detach()), path


def _reference() -> list:
    """One process's 3 steps: (loss, {name: gradient}, {name: updated parameter}) per step."""
    ref = tiny_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    steps = []
    for step in range(3):
        loss = ref(*global_batch(step))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        steps.append((loss.item(), grads, {n: p.detach().clone() for n, p in ref.named_parameters()}))
    return steps


def _train(spec, zero, offload, planned, reference, accumulate=False):
    sizes, rules = _rules(spec, zero)
    mesh = spmd.make_mesh(sizes)
    model = spmd.parallelize(tiny_model(), mesh, rules, offload=offload)
    # fused, as the trainer's: a group holding masters that are strided views of their shards steps unfused
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True))
    for step, (ref_loss, ref_grads, ref_params) in enumerate(reference):
        tokens, targets = global_batch(step)
        recorder = GatherInputs(mesh) if step == 0 else contextlib.nullcontext()  # a dispatch mode: slow
        with recorder:
            loss = _forward_backward(model, local_slice(tokens, mesh), local_slice(targets, mesh), accumulate)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (spec, zero, step, loss, ref_loss)
        grads = sum(_local_nbytes(p.grad) for p in model.parameters())  # stage 1: whole, not yet reduced
        with recorder:
            spmd.reduce_gradients(model)  # where the trainer clips: the norm sees reduced gradients
        for name, p in model.named_parameters():
            want = p._spmd_optim if zero == 1 else p._spmd_grads
            assert tuple(p.grad.placements) == tuple(want), (name, p.grad.placements, want)
            err = norm_rel_err(p.grad.full_tensor(), ref_grads[name])
            assert err <= TOL, f"{spec} zero={zero} step {step}: gradient of {name} off by {err:.2e}"
        with recorder:
            opt.step()
        if step == 0 and planned is not None:
            memory, comm = planned
            got = _measured_memory(model, opt, grads, offload)
            if offload == "params":  # every gather read a device copy, never the shard stored on the host
                assert recorder.inputs and not recorder.inputs & {_storage(p) for p in model.parameters()}
            assert set(got) == set(memory) - {"activations", "total", "peak"}, (got, memory)
            assert got == {k: memory[k] for k in got}, f"{spec} zero={zero}: measured {got}, plan {memory}"
            measured = _comm([c for c in recorder.records if c.origin == "planned"])
            assert measured == comm, f"{spec} zero={zero}: measured {measured}, plan {comm}"
            if zero == 1:  # the step's reductions in flat buffers: one collective per mesh axis and kind
                reductions = collections.Counter(
                    (c.kind, c.axes) for c in recorder.records if c.phase == "optimizer" and c.kind != "all_gather"
                )
                if torch.distributed.get_rank() == 0:
                    print(f"{spec} zero=1 step reductions: {dict(reductions)}")
                assert reductions and set(reductions.values()) == {1}, (spec, reductions)
            if zero in (1, 2) and not (offload or "").startswith("nvme:"):  # the updated shards: one buffer
                gathers = [c for c in recorder.records if c.phase == "optimizer" and c.kind == "all_gather"]
                assert len(gathers) == 1, (spec, zero, [c.reason for c in gathers])
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref_params[name])
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


def _bf16_master_in_optimizer(planned, reference):
    """bf16 parameters and bf16 gradient reduction, the fp32 master with AdamW's moments (stage 2, fsdp=4):
    the bytes equal the plan's exactly, and 3 steps track fp32 one-process training within BF16_TOL."""
    sizes, rules = _rules("fsdp=4", 2)
    model = spmd.parallelize(
        tiny_model(),
        spmd.make_mesh(sizes),
        rules,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.bfloat16,
        master="optimizer",
    )
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {m.dtype for _, m in _masters(opt)} == {torch.float32}
    for step, (ref_loss, _, ref_params) in enumerate(reference):
        tokens, targets = global_batch(step)
        loss = model(local_slice(tokens, model._spmd_state.mesh), local_slice(targets, model._spmd_state.mesh))
        loss.backward()
        assert abs(loss.item() - ref_loss) <= BF16_TOL * abs(ref_loss), (step, loss.item(), ref_loss)
        grads = sum(_local_nbytes(p.grad) for p in model.parameters())
        opt.step()
        if step == 0:
            got = _measured_memory(model, opt, grads, None)
            assert got == {k: planned[k] for k in got}, f"bf16 master=optimizer: measured {got}, plan {planned}"
        opt.zero_grad()
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor().float(), ref_params[name])
            assert err <= BF16_TOL, f"bf16 step {step}: parameter {name} off by {err:.2e}"
    for p, m in _masters(opt):  # the parameters are the masters rounded to bf16
        assert torch.equal(p.full_tensor(), m.full_tensor().to(torch.bfloat16)), p._spmd_name


def _stage1_checkpoint_loads_into_stage3(model, opt, tmp):
    checkpoint.save(tmp, 3, checkpoint.model_state(model), checkpoint.optim_state(model, opt))
    sizes, rules = _rules("fsdp=4", 3)
    other = spmd.parallelize(tiny_model(seed=7), spmd.make_mesh(sizes), rules)
    other_opt = spmd.shard_optimizer(other, torch.optim.AdamW(other.parameters()))
    checkpoint.load(tmp, checkpoint.model_state(other), checkpoint.optim_state(other, other_opt, init=True))
    saved, loaded = checkpoint.optim_state(model, opt), checkpoint.optim_state(other, other_opt)
    for name, t in saved.items():
        assert torch.equal(
            loaded[name].full_tensor() if hasattr(loaded[name], "full_tensor") else loaded[name],
            t.full_tensor() if hasattr(t, "full_tensor") else t,
        ), name
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


def _uneven_step_reduction():
    """The step's flat-buffer reduction of gradients whose chunks differ in size (one empty), and of one that
    shards two dims over dp and fsdp, equals DTensor's redistribute of each within 1e-6 (sums of 4 normal
    values; gloo may add them in another order for another buffer size)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from spmd.runtime.gradients.step_reduce import reduce_all_to

    mesh = spmd.make_mesh({"dp": 2, "fsdp": 2})
    torch.manual_seed(torch.distributed.get_rank())
    shapes = [(5, 3), (7,), (3, 9), (1, 4), (6, 6)]
    targets = [(Replicate(), Shard(0))] * 2 + [(Replicate(), Shard(1)), (Replicate(), Shard(0)), (Shard(0), Shard(1))]
    grads = [DTensor.from_local(torch.randn(s), mesh, (Partial(), Partial()), run_check=False) for s in shapes]
    for got, g, t in zip(reduce_all_to(grads, targets, "test"), grads, targets):
        want = g.redistribute(mesh, t)
        assert tuple(got.placements) == t and got.to_local().shape == want.to_local().shape, (g.shape, t)
        assert torch.allclose(got.to_local(), want.to_local(), rtol=0, atol=1e-6), (g.shape, t)


def _uneven_gather():
    """The all-gather of updated shards in one flat buffer, for chunks that differ in size (one empty) along
    different dims, gives back each whole tensor exactly (gathers copy)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from spmd.runtime import collectives

    mesh = spmd.make_mesh({"dp": 2, "fsdp": 2})
    torch.manual_seed(0)
    wholes = [torch.randn(s) for s in [(5, 3), (7,), (3, 9), (1, 4)]]
    dims = [0, 0, 1, 0]
    shards = [distribute_tensor(w, mesh, (Replicate(), Shard(d))).to_local() for w, d in zip(wholes, dims)]
    assert shards[3].numel() == (4 if mesh.get_local_rank(1) == 0 else 0)  # one rank's chunk is empty
    for got, want in zip(collectives.all_gather(shards, dims, [w.shape for w in wholes], mesh, 1), wholes):
        assert torch.equal(got, want), want.shape


def _two_mesh_axes_on_one_dim(reference):
    """A rules table putting mlp's gradients (and so its optimizer state) on fsdp and tp, where tp already splits
    them: a reduce-scatter over fsdp would land tp's chunk's rows, so those gradients reduce through DTensor and
    equal one process's within TOL. shard_optimizer then refuses the optimizer map on every rank: only ranks
    whose optimizer chunk lies outside their stored chunk would raise, and the others would wait in backward."""
    from torch.distributed.tensor import Shard

    mesh = spmd.make_mesh({"fsdp": 2, "tp": 2})
    rules = spmd.Rules(spmd.Rules.default().compute, grads={"mlp": ("fsdp", "tp")})
    model = spmd.parallelize(tiny_model(), mesh, rules)
    tokens, targets = global_batch(0)
    model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
    assert model.layers[0].feed_forward.w1.weight.grad.placements == (Shard(0), Shard(0))
    for name, p in model.named_parameters():
        assert tuple(p.grad.placements) == tuple(p._spmd_grads), name
        err = norm_rel_err(p.grad.full_tensor(), reference[0][1][name])
        assert err <= TOL, f"mlp over fsdp and tp: gradient of {name} off by {err:.2e}"
    with pytest.raises(ValueError, match="not inside its stored shard .* on every rank"):
        spmd.shard_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _all_runs(rank, world, plans, bf16_plan, reference, wide, tmp):
    _two_mesh_axes_on_one_dim(reference)
    _uneven_step_reduction()
    _uneven_gather()
    for (spec, zero, offload), planned in zip(RUNS, plans):
        model, opt = _train(spec, zero, _in(offload, tmp), planned, reference, (spec, zero, offload) in ACCUMULATE)
        if (spec, zero, offload) == ("fsdp=4", 1, None):
            _stage1_checkpoint_loads_into_stage3(model, opt, tmp)
    _train("dp=2,fsdp=2", 2, "optimizer", None, reference, accumulate=True)
    _bf16_master_in_optimizer(bf16_plan, reference)
    nvme_streams_its_state(wide, f"{tmp}/wide")


@pytest.mark.slow
def test_zero_stages_match_one_device_and_their_plans(tmp_path):
    plans = [_plan(spec, zero, _in(offload, str(tmp_path))) for spec, zero, offload in RUNS]
    by_stage = {
        zero: comm for (spec, zero, offload), (_, comm) in zip(RUNS, plans) if spec == "fsdp=4" and offload != "params"
    }
    params_offload = plans[RUNS.index(("fsdp=4", 3, "params"))][1]
    by_stage[0] = _plan("fsdp=4", 0)[1]
    psi = 4 * sum(p.numel() for p in tiny_model().parameters())
    ring = psi * 3 // 4
    # the parameters outside the blocks (the root unit) stay gathered from forward to backward, as FSDP2's root
    root = 4 * sum(p.numel() for n, p in tiny_model().named_parameters() if not n.startswith("layers.")) * 3 // 4
    formulas = {
        0: {("backward", "all_reduce"): 2 * ring},
        1: {("optimizer", "reduce_scatter"): ring, ("optimizer", "all_gather"): ring},
        2: {("backward", "reduce_scatter"): ring, ("optimizer", "all_gather"): ring},
        3: {
            ("forward", "all_gather"): ring,
            ("backward", "all_gather"): ring - root,
            ("backward", "reduce_scatter"): ring,
        },
    }
    for zero, comm in sorted(by_stage.items()):
        print(f"zero={zero}: planned {comm}, formula {formulas[zero]}, total/Ψ' {sum(comm.values()) / ring:.4f}")
        assert comm == formulas[zero], (zero, comm)
    # with its shards on the host, stage 3 moves each parameter on its own: no root unit kept gathered, only
    # the input embedding (its backward reads token ids alone) is not regathered
    embedding = 4 * tiny_model().tok_embeddings.weight.numel() * 3 // 4
    assert params_offload == formulas[3] | {("backward", "all_gather"): ring - embedding}, params_offload
    sizes, rules = _rules("fsdp=4", 2)
    bf16_plan = spmd.explain(
        tiny_model(),
        rules,
        sizes,
        batch_shape=(BATCH, SEQ),
        dtype=torch.bfloat16,
        reduce_dtype=torch.bfloat16,
        master="optimizer",
    ).memory
    run_distributed(_all_runs, 4, plans, bf16_plan, _reference(), wide_reference(), str(tmp_path), timeout_s=400)
