"""spmd.compile_blocks: every block compiles, checkpointed ones included (their body, with torch's checkpoint
outside the graph), and the numbers stay those of one device.

One process: with backend "eager" (dynamo's captured graph without inductor: same ops, same order) the
gradients equal the uncompiled model's bit for bit. Four processes: fsdp x tp x sp, every second block
checkpointed, two micro-batches (the first under no_sync, after which every block's gradient is still a
partial sum over the data axes: reduced once per step, not per micro-batch), backend "aot_eager" (AOTAutograd's joint
graph and its partition into forward and backward, where a DeviceMesh saved for backward or a process group looked
up at run time fail, without inductor's code generation): 2 AdamW steps match one eager device within 1e-5
(fp32), with no graph break and one graph for every block, checkpointed or not, and for the recompute.
Backend "inductor" runs the same case, collectives inside its generated graphs, within the same 1e-5.
ZeRO stages 1 and 2 compile too: a block's
graph reduce-scatters stage-2 gradients onto the optimizer's shards and leaves stage-1 gradients partial
sums for the step, which the test checks on the gradients' placements before the step.

Blocks with data-only layouts (`fsdp=4`, `dp=2,fsdp=2`) compile their forward alone, on local tensors: the
graphs' inputs hold no DTensor, and with two micro-batches under no_sync 2 AdamW steps match one device
within 1e-5. A call of such a block that takes the DTensor path (a plain tensor of the global batch's shape
among its inputs) traces that path in the same compiled forward, and matches one device too. Compiled data-only
blocks issue eager's collectives (the bucket gathers, prefetches and reductions), and a checkpointed compiled
block, which gathers inside its graph, is not prefetched for: forward gathers the bytes eager does.

Two steps prove what a third did: the first compares the gradients and Adam's first update, the second the
gradients taken at the updated parameters (through graphs compiled once, not again) and an update that reads
the moments the first stored.
"""

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, local_slice, norm_rel_err, tiny_model

TOL = 1e-5
STEPS = 2


def test_checkpointed_blocks_compile_and_gradients_are_unchanged():
    ref, model = tiny_model(n_layers=4), tiny_model(n_layers=4)
    assert spmd.apply_activation_checkpointing(model, "selective:2") == [0, 2]
    assert spmd.compile_blocks(model, backend="eager") == [0, 1, 2, 3]
    tokens, targets = global_batch(0)
    ref(tokens, targets).backward()
    model(tokens, targets).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_params[name].grad), name


def _compiled_steps(rank, world, spec, ac, accum, backend, zero=3):
    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    ref, model = tiny_model(), tiny_model()
    spmd.parallelize(model, mesh, spmd.Rules.default(sequence_parallel="sp" in flags, zero=zero))
    spmd.apply_activation_checkpointing(model, ac)
    assert spmd.compile_blocks(model, backend=backend) == list(range(len(model.layers)))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (model, ref))
    opt = spmd.shard_optimizer(model, opt)
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        n = len(tokens) // accum
        for j in range(accum):
            x, y = tokens[j * n : (j + 1) * n], targets[j * n : (j + 1) * n]
            with spmd.no_sync(model) if j < accum - 1 else contextlib.nullcontext():
                (model(local_slice(x, mesh), local_slice(y, mesh)) / accum).backward()
            (ref(x, y) / accum).backward()
            if j < accum - 1:
                _check_block_gradients_unreduced(model)
        if zero < 3:
            _check_block_gradients_in_step_layout(model, zero)
        spmd.reduce_gradients(model)
        for name, p in model.named_parameters():
            err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
            assert err <= TOL, f"{spec} step {step}: gradient of {name} off by {err:.2e}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref_params[name].detach())
            assert err <= TOL, f"{spec} step {step}: parameter {name} off by {err:.2e}"
    from torch._dynamo.utils import counters

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["ok"] == counters["frames"]["total"], dict(counters["frames"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _each_compiled(rank, world, cases):
    """Several `_compiled_steps` cases in one launch, each counting its graphs from a reset compiler."""
    from torch._dynamo.utils import counters

    for case in cases:
        torch._dynamo.reset()
        counters.clear()
        _compiled_steps(rank, world, *case)


def _check_block_gradients_unreduced(model):
    """Under no_sync a compiled block leaves each gradient a partial sum over the data axes (reduced once, by
    the last micro-batch's backward)."""
    data_axes = [
        m
        for m, name in enumerate(model.layers[0].attention.wq.weight.device_mesh.mesh_dim_names)
        if name in ("dp", "fsdp")
    ]
    for name, p in model.layers.named_parameters():
        assert all(p.grad.placements[m].is_partial() for m in data_axes), (name, p.grad.placements)


def _check_block_gradients_in_step_layout(model, zero):
    """After backward, before the step: a compiled block's gradient is reduce-scattered onto the optimizer's
    shards (ZeRO-2) or still a partial sum over the axes the optimizer's shards add (ZeRO-1)."""
    from spmd.runtime.gradients.layouts import grads_layout, optim_layout

    moved = 0
    for name, p in model.layers.named_parameters():
        added = [m for m, (s, o) in enumerate(zip(p.placements, optim_layout(p))) if s != o]
        if not added:
            continue
        moved += 1
        if zero == 2:
            assert tuple(p.grad.placements) == grads_layout(p) != tuple(p.placements), (name, p.grad.placements)
        else:
            assert all(p.grad.placements[m].is_partial() for m in added), (name, p.grad.placements)
    assert moved, "no block parameter has optimizer shards beyond its storage"


@pytest.mark.slow
def test_compiled_checkpointed_accumulated_steps_and_zero_stages_1_and_2_match_one_device():
    """In one launch, on fsdp x tp x sp with aot_eager: ZeRO-3 (the default), then stages 1 and 2, whose compiled
    blocks hold gradients as the stage says (stage 2 reduce-scattered onto the optimizer's shards in backward,
    stage 1 unreduced for the step); the numbers stay one device's."""
    cases = [("fsdp=2,tp=2,sp", "selective:2", 2, "aot_eager", zero) for zero in (3, 1, 2)]
    run_distributed(_each_compiled, 4, cases, timeout_s=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_with_collectives_in_the_graphs_matches_one_device():
    """Backend "inductor" (its generated C++ kernels, and the all-gathers, reduce-scatters and all-reduces of
    fsdp x tp x sp inside the block graphs, bucketed by inductor), every second block checkpointed, two
    micro-batches: 2 AdamW steps match one eager device within TOL (fp32; the fused kernels reorder sums by
    ~1e-7), with one graph for every block."""
    run_distributed(_compiled_steps, 4, "fsdp=2,tp=2,sp", "selective:2", 2, "inductor", timeout_s=900)


_GRAPH_TAKES_DTENSOR = []  # per graph compiled in this process: whether any of its inputs is a DTensor


def _recording_backend(gm, example_inputs):
    from torch._dynamo.backends.debugging import aot_eager

    _GRAPH_TAKES_DTENSOR.append(any(isinstance(t, DTensor) for t in example_inputs))
    return aot_eager(gm, example_inputs)


def _local_compiled_steps(rank, world, specs):
    for spec in specs:
        _GRAPH_TAKES_DTENSOR.clear()
        _each_compiled(rank, world, [(spec, "none", 2, _recording_backend)])
        assert _GRAPH_TAKES_DTENSOR and not any(_GRAPH_TAKES_DTENSOR), (spec, _GRAPH_TAKES_DTENSOR)


@pytest.mark.slow
def test_data_only_blocks_compile_their_forward_on_local_tensors():
    run_distributed(_local_compiled_steps, 4, ["fsdp=4", "dp=2,fsdp=2"], timeout_s=600)


class _GatedBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, h, keep):
        return h + torch.tanh(self.proj(h)) * keep


class _GatedModel(nn.Module):
    """Blocks fed a gate the model makes from the global shapes, as transformers' models make their masks."""

    def __init__(self, vocab=64, dim=16, n_layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([_GatedBlock(dim) for _ in range(n_layers)])
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        keep = torch.ones(h.shape[0], h.shape[1], 1)
        for layer in self.layers:
            h = layer(h, keep)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def _dtensor_path_compiled_steps(rank, world):
    mesh = spmd.make_mesh({"fsdp": world})
    ref, model = _GatedModel(), _GatedModel()
    spmd.annotate_by_name(
        model,
        {
            "embed.weight": ("vocab", "embed"),
            "out.weight": ("vocab", "embed"),
            "*.proj.weight": ("mlp", "embed"),
            "*.proj.bias": "mlp",
        },
    )
    spmd.parallelize(model, mesh, spmd.Rules.default())
    spmd.compile_blocks(model, backend=_recording_backend)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        tokens, targets = (t % 64 for t in global_batch(step))
        model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
        ref(tokens, targets).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref_params[name].detach())
            assert err <= TOL, f"step {step}: parameter {name} off by {err:.2e}"
    assert any(_GRAPH_TAKES_DTENSOR), _GRAPH_TAKES_DTENSOR  # the DTensor path was traced, not the local one


def test_a_data_only_block_on_the_dtensor_path_compiles_that_path():
    run_distributed(_dtensor_path_compiled_steps, 2, timeout_s=300)


def _profiled_step(mesh, ac: str, compiled: bool) -> tuple:
    """The second step's collectives, (name, gathered shape) in order, for forward and for backward, counted from
    gloo's own calls by torch's profiler (spmd's recorder is a dispatch mode, under which dynamo runs compiled
    code eagerly: it would compare eager with eager), and how many compiled regions ran in the step."""
    model = tiny_model()
    spmd.parallelize(model, mesh, spmd.Rules.default())
    spmd.apply_activation_checkpointing(model, ac)
    if compiled:
        spmd.compile_blocks(model, backend="aot_eager")
    for step in range(2):  # the second step, after the first compiled
        tokens, targets = global_batch(step)
        with _profile() as fwd:
            loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
        with _profile() as bwd:
            loss.backward()
    events = [list(prof.events()) for prof in (fwd, bwd)]
    calls = [[(e.name, tuple(e.input_shapes[0])) for e in ev if e.name.startswith("gloo:")] for ev in events]
    regions = sum(e.name.startswith("Torch-Compiled Region") for ev in events for e in ev)
    return calls[0], calls[1], regions


def _profile():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)


def _gathered(calls: list) -> int:
    return sum(math.prod(shape) for name, shape in calls if name == "gloo:all_gather")


def _compiled_schedules(rank, world):
    """Data-only compiled blocks issue eager's very collectives, forward and backward; checkpointed compiled
    blocks gather inside their graphs, parameter by parameter, and forward gathers as many values as eager's
    buckets. Mutation that fails it (tried): a compile_blocks that leaves data-only blocks' forward uncompiled
    (the compiled regions are counted)."""
    mesh = spmd.make_mesh({"fsdp": world})
    *compiled, regions = _profiled_step(mesh, "none", True)
    *eager, none = _profiled_step(mesh, "none", False)
    assert regions > 0 and none == 0, (regions, none)
    assert compiled == eager, (compiled, eager)
    fwd, _, regions = _profiled_step(mesh, "full", True)
    eager_fwd, _, _ = _profiled_step(mesh, "full", False)
    assert regions > 0 and len(fwd) > len(eager_fwd), (regions, fwd, eager_fwd)  # gathers in the graphs
    assert _gathered(fwd) == _gathered(eager_fwd) > 0, (fwd, eager_fwd)


def test_compiled_blocks_gather_what_eager_gathers():
    run_distributed(_compiled_schedules, 2, timeout_s=300)
