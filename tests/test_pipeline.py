"""Pipeline parallelism trains the tiny model like one device: every schedule, pp=2 and pp=4, and pp composed
with fsdp, tp+sp and dp.

Each case builds the pipeline on gloo processes, runs 2 AdamW steps and compares with the same model trained
in one process on the whole batch: the loss (on every rank, not only the last stage), every gradient before
the optimizer step, and every updated parameter, all within 1e-5 norm-relative, the tolerance of
test_spmd_numerics.py.

Why float64: the pipeline sums a micro-batch's gradients into the next, in a different order than one
device does. AdamW's first steps divide each gradient element by its own magnitude, so an element near
zero turns a 1e-7 fp32 rounding difference into a parameter change of order 1e-5 (one device with the same
micro-batches does this too: 3.6e-6 on the 4-layer model, 1.2e-5 on the 8-layer one, whose output
projections are scaled down by depth; spmd's tp=2 without any pipeline gives 1.2e-5 on it as well). In
float64 rounding stays near 1e-7 (the kernels upcast some ops to float32 only), a hundred times inside the
tolerance, while a structural error (a micro-batch lost or counted twice, a wrong loss scale, a gradient
not reduced) is off by 1e-2 or more. One fp32 case checks losses and gradients of the first step as well.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import spmd
from models.llama import Llama, LlamaConfig
from spmd import checkpoint
from spmd.analysis.record import CollectiveRecorder
from tests.dist_utils import run_distributed
from tests.spmd_cases import BATCH, SEQ, global_batch, local_slice, norm_rel_err

TOL = 1e-5
SCHEDULES = [("gpipe", 1, 2), ("1f1b", 1, 4), ("interleaved-1f1b", 2, 4), ("zero-bubble", 2, 4), ("zbv", 2, 4)]


def _model(n_layers, dtype=torch.float64):
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny", kernels="torch", n_layers=n_layers)).to(dtype)


def _check(
    mesh,
    rules,
    spec,
    schedule,
    v,
    M,
    n_layers,
    dtype=torch.float64,
    steps=2,
    extra=False,
    ac="none",
    plan=None,
    ckpt=None,
    zero=None,
    offload=None,
):
    what = f"{spec} {schedule} v={v} M={M} {dtype} ac={ac} zero={zero} offload={offload}"
    ref = _model(n_layers, dtype)
    pipe = spmd.build_pipeline(
        _model(n_layers, dtype),
        mesh,
        rules,
        schedule=schedule,
        microbatches=M,
        virtual_stages=v,
        reduce_dtype=None if dtype == torch.float64 else torch.float32,
        ac=ac,
        offload=offload,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)
    if zero is not None:  # the optimizer steps on the optimizer map's shards, as the trainer's
        spmd.shard_optimizer(pipe, opt)
    if offload not in (None, "params"):  # every master a copy of its parameter's shard, apart from the device's
        params = dict(pipe.named_parameters())
        masters = spmd.runtime.optimizer.shard.masters_of(opt)
        assert len(masters) == len(params), (what, len(masters), len(params))
        for m in (m for g in opt.param_groups for m in g["params"]):
            assert m._local_tensor.data_ptr() != masters[id(m)]._local_tensor.data_ptr(), what
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in pipe.named_parameters()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    assert set().union(*everyone) == set(ref_params), f"{what}: the stages do not hold the model's parameters"
    for step in range(steps):
        tokens, targets = global_batch(step)
        recorder = CollectiveRecorder(pipe.mesh)
        with recorder:
            loss = pipe.step(local_slice(tokens, pipe.stage_mesh), local_slice(targets, pipe.stage_mesh))
            if zero is not None:  # ZeRO-1's held gradients reduced into the optimizer's shards, before clipping
                spmd.reduce_gradients(pipe)
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        assert not isinstance(loss, torch.distributed.tensor.DTensor)
        assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (what, step, loss, ref_loss)
        for name, p in pipe.named_parameters():
            err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
            assert err <= TOL, f"{what} step {step}: gradient of {name} off by {err:.2e}"
        reductions = [c.reason for c in recorder.records if c.reason.startswith("reduce gradient")]
        assert len(reductions) == len(set(reductions)), f"{what}: a gradient was reduced more than once in a step"
        if plan is not None and step == 0 and zero is None:
            _check_plan(pipe, recorder.records, plan, what)
        if extra and step == 0:
            _check_clipping(pipe, ref, what)
        if dtype != torch.float64 and zero is None:
            return
        stepped = CollectiveRecorder(pipe.mesh)
        with stepped:  # under ZeRO-1/2: the all-gather of the updated shards
            opt.step()
        if plan is not None and step == 0 and zero is not None:
            _check_plan(pipe, recorder.records + stepped.records, plan, what)
        if zero in (1, 2) and step == 0:
            _check_zero_collectives(recorder.records + stepped.records, zero, what)
        if dtype != torch.float64:
            return
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in pipe.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref_params[name].detach())
            assert err <= TOL, f"{what} step {step}: parameter {name} off by {err:.2e}"
    if extra:
        _check_accumulation(pipe, ref, what)
    if ckpt:
        _check_checkpoints(pipe, opt, ref, ref_opt, n_layers, dtype, ckpt, what)


def _check_checkpoints(pipe, opt, ref, ref_opt, n_layers, dtype, path, what):
    """A checkpoint written by the pipeline loads into one unsplit model, and one written by an unsplit
    model loads into a pipeline: parameter names are the model's, so the index is global."""
    checkpoint.save(f"{path}/pp", 3, checkpoint.model_state(pipe.module), checkpoint.optim_state(pipe.module, opt))
    whole = _model(n_layers, dtype)
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-3, weight_decay=0.1)
    checkpoint.load(f"{path}/pp", checkpoint.model_state(whole), checkpoint.optim_state(whole, whole_opt, init=True))
    for (name, p), q in zip(ref.named_parameters(), whole.parameters()):
        assert norm_rel_err(q.detach(), p.detach()) <= TOL, f"{what}: {name} after pp=2 -> pp=1"
        assert norm_rel_err(whole_opt.state[q]["exp_avg"], ref_opt.state[p]["exp_avg"]) <= TOL, (what, name)
    checkpoint.save(f"{path}/one", 3, checkpoint.model_state(ref), checkpoint.optim_state(ref, ref_opt))
    torch.manual_seed(1)
    other = spmd.build_pipeline(
        Llama(LlamaConfig.preset("tiny", kernels="torch", n_layers=n_layers)).to(dtype),
        pipe.mesh,
        pipe.rules,
        schedule="1f1b",
        microbatches=2,
    )
    state = checkpoint.model_state(other.module)
    assert set(state) <= set(n[len("model.") :] for n in checkpoint.tensor_names(f"{path}/one"))
    checkpoint.load(f"{path}/one", state, strict=False)  # this rank's stages only
    ref_params = dict(ref.named_parameters())
    for name, p in other.named_parameters():
        assert norm_rel_err(p.full_tensor(), ref_params[name].detach()) <= TOL, f"{what}: {name} after pp=1 -> pp=2"


def _check_zero_collectives(records, zero, what):
    """Over fsdp, a stage-1 step reduces gradients once, in the optimizer phase (a reduce-scatter into the
    optimizer's shards), a stage-2 step in backward (a reduce-scatter); neither all-reduces a gradient, and
    both all-gather the updated shards after the step. (The forward's all-reduces are the loss's.)"""
    kinds = Counter((c.phase, c.kind) for c in records if c.axes == ("fsdp",))
    reduced_in = "optimizer" if zero == 1 else "backward"
    assert kinds[(reduced_in, "reduce_scatter")] > 0, (what, kinds)
    assert kinds[("optimizer", "all_gather")] > 0, (what, kinds)
    assert not any(k == "all_reduce" and phase != "forward" for phase, k in kinds), (what, kinds)
    if zero == 1:
        assert kinds[("backward", "reduce_scatter")] == 0, (what, kinds)


def _key(c):
    return (c.module, c.kind, c.axes, c.bytes, c.phase, c.reason)


def _check_plan(pipe, records, plan, what):
    """explain's plan for the pp rank it reports lists the collectives this step issued on that rank, and
    the activations each rank sent have the shape and count the plan gives."""
    expected, rank, shape, sends = plan
    if pipe.pp_rank == rank:
        got = Counter(_key(c) for c in records if c.kind not in ("send", "recv", "broadcast"))
        assert got == expected, f"{what}: real run minus plan {got - expected}, plan minus real run {expected - got}"
    activations = [c for c in records if c.kind in ("send", "recv") and c.shape == shape]
    assert len(activations) == sends[pipe.pp_rank], (what, len(activations), sends)


def _check_clipping(pipe, ref, what):
    """The norm of all gradients across stages equals one device's, and clipping scales them alike."""
    max_norm = 0.01
    norm = pipe.clip_grad_norm_(max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    assert abs(norm.item() - ref_norm.item()) <= TOL * ref_norm.item(), (what, norm, ref_norm)
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert norm_rel_err(p.grad.full_tensor(), ref_params[name].grad) <= TOL, f"{what}: clipped {name}"


def _check_accumulation(pipe, ref, what):
    """step(sync=False) then step(): gradients of both batches summed, reduced once."""
    for p in list(pipe.parameters()) + list(ref.parameters()):
        p.grad = None
    for step, sync in ((3, False), (4, True)):
        tokens, targets = global_batch(step)
        pipe.step(local_slice(tokens, pipe.stage_mesh), local_slice(targets, pipe.stage_mesh), sync=sync)
        ref(tokens, targets).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), (what, name, p.grad.placements)
        err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
        assert err <= TOL, f"{what}: accumulated gradient of {name} off by {err:.2e}"


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _Plain(torch.nn.Module):
    """A model with a block list but no embed/block_inputs/head parts: only torch's tracer can cut it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.out = torch.nn.Linear(32, 64)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _ce(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check_traced(mesh, schedule, v, M):
    """A model without parts runs through torch's tracing front end, cut where split_stages says."""
    torch.manual_seed(0)
    ref = _Plain().double()
    torch.manual_seed(0)
    tokens, targets = (t % 64 for t in global_batch(0))
    pipe = spmd.build_traced_pipeline(
        _Plain().double(),
        mesh,
        (tokens[: BATCH // M],),
        _ce,
        schedule=schedule,
        microbatches=M,
        virtual_stages=v,
        split_cost="params",
    )
    loss = pipe.step(tokens, targets)
    ref_loss = _ce(ref(tokens), targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item(), (schedule, loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in pipe.named_parameters()]
    assert names and set(names) <= set(ref_params)
    for name, p in pipe.named_parameters():
        assert norm_rel_err(p.grad, ref_params[name].grad) <= TOL, (schedule, name)


def _run_cases(rank, world, cases):
    for spec, n_layers, configs in cases:
        sizes, flags = spmd.parse_spec(spec)
        mesh = spmd.make_mesh(sizes)
        for schedule, v, M, *options in configs:
            if options and options[0].get("traced"):
                _check_traced(mesh, schedule, v, M)
                continue
            zero = options[0].get("zero") if options else None
            rules = spmd.Rules.default(sequence_parallel="sp" in flags, zero=3 if zero is None else zero)
            _check(mesh, rules, spec, schedule, v, M, n_layers, **(options[0] if options else {}))


@pytest.mark.slow
def test_every_schedule_on_two_stages_matches_one_device(tmp_path):
    """Also: fp32, activation checkpointing, and checkpoints that load across pp sizes."""
    configs = [
        ("gpipe", 1, 2, {"ckpt": str(tmp_path)}),
        *SCHEDULES[1:],
        ("1f1b", 1, 2, {"dtype": torch.float32}),
        ("1f1b", 1, 2, {"ac": "full", "steps": 1}),
        ("1f1b", 1, 2, {"traced": True}),
        ("interleaved-1f1b", 2, 2, {"traced": True}),
    ]
    run_distributed(_run_cases, 2, [("pp=2", 4, configs)], timeout_s=240)


@pytest.mark.slow
def test_every_schedule_on_four_stages_matches_one_device():
    configs = [(s, v, 8 if s == "zbv" else 4) for s, v, _ in SCHEDULES]
    run_distributed(_run_cases, 4, [("pp=4", 8, configs)], timeout_s=300)


def _plan_check(spec, zero=3, **kwargs):
    """What _check_plan holds a run against: explain's plan for `spec` (made here, on a fake world)."""
    sizes, flags = spmd.parse_spec(spec)
    plan = spmd.explain(
        _model(4, torch.float32),
        spmd.Rules.default(sequence_parallel="sp" in flags, zero=zero),
        sizes,
        batch_shape=(BATCH, SEQ),
        **kwargs,
    )
    p = plan.pipeline
    sends = [sum(c.kind in ("send", "recv") for c in plan.collectives)] * p["pp"]  # 2 per micro-batch per boundary
    expected = Counter(_key(c) for c in plan.collectives if c.kind not in ("send", "recv", "broadcast"))
    return expected, p["reported_rank"], tuple(p["activation_shape"]), sends


def _zero_stage_configs(tmp_path) -> list:
    """The pp=2,fsdp=2 configs with ZeRO stages and offload."""
    return [
        ("1f1b", 1, 2, {"zero": 1, "ckpt": str(tmp_path)}),
        ("zero-bubble", 2, 4, {"zero": 1}),
        ("1f1b", 1, 2, {"zero": 2}),
        ("gpipe", 1, 2, {"zero": 0}),
        ("1f1b", 1, 2, {"zero": 1, "offload": "optimizer"}),
        ("gpipe", 1, 2, {"zero": 3, "offload": "optimizer"}),
        ("1f1b", 1, 2, {"zero": 3, "offload": "params"}),
        ("1f1b", 1, 2, {"zero": 2, "offload": f"nvme:{tmp_path}/nvme"}),
        (
            "1f1b",
            1,
            2,
            {
                "zero": 1,
                "dtype": torch.float32,
                "steps": 1,
                "plan": _plan_check("pp=2,fsdp=2", 1, schedule="1f1b", microbatches=2),
            },
        ),
        (
            "1f1b",
            1,
            2,
            {
                "zero": 2,
                "dtype": torch.float32,
                "steps": 1,
                "plan": _plan_check("pp=2,fsdp=2", 2, schedule="1f1b", microbatches=2),
            },
        ),
    ]


@pytest.mark.slow
def test_pipeline_matches_one_device_with_zero_stages_and_composed_with_fsdp_tp_sp_and_dp(tmp_path):
    """pp composed with fsdp, tp+sp and dp; explain's plan for pp=2,fsdp=2 (made here, on a fake world) lists
    what the real step does. ZeRO stages with a pp axis: the optimizer steps on each stage's optimizer-map shards
    (spmd.shard_optimizer(pipeline, opt)); stage 1 leaves gradients unreduced over the micro-batches and
    spmd.reduce_gradients(pipeline) reduce-scatters them once, stage 2 reduce-scatters in the last backward;
    both all-gather the updated shards after the step. Gradients (in the optimizer's layout), losses and
    updated parameters equal one device, and an fp32 step issues exactly the collectives explain plans for it.
    With offload="optimizer" (stages 1 and 3) and "nvme:DIR" (stage 2) every master is a copy apart from
    the device's parameters, and the numbers are the same. A stage-1 pipeline's checkpoint (sharded optimizer
    states) loads into one unsplit model.
    One launch: the ZeRO cases and the plain ones share the pp=2,fsdp=2 mesh and DTensor's decisions for it."""
    check = _plan_check("pp=2,fsdp=2", schedule="1f1b", microbatches=2)
    cases = [
        (
            "pp=2,fsdp=2",
            4,
            [
                ("1f1b", 1, 2, {"extra": True}),
                ("zero-bubble", 2, 4),
                ("1f1b", 1, 2, {"dtype": torch.float32, "plan": check}),
                *_zero_stage_configs(tmp_path),
            ],
        ),
        ("pp=2,tp=2,sp", 4, [("interleaved-1f1b", 2, 4), ("zbv", 2, 4)]),
        ("pp=2,dp=2", 4, [("gpipe", 1, 2), ("1f1b", 1, 2)]),
    ]
    run_distributed(_run_cases, 4, cases, timeout_s=400)
