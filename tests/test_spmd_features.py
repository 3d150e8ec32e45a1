"""Bucketed against per-parameter collectives, activation checkpointing, gradient accumulation under no_sync,
meta-device initialisation, pinned layouts and name-table annotations, each checked against the plain
computation."""

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.analysis.record import CollectiveRecorder
from tests.dist_utils import run_distributed
from tests.spmd_cases import BATCH, SEQ, global_batch, local_slice, norm_rel_err, tiny_model


class HFStyleMLP(nn.Module):
    """A module written without spmd in mind: annotated from outside by parameter-name patterns."""

    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(16, 32)
        self.down_proj = nn.Linear(32, 16)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x))).pow(2).mean()


def _grads(model):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()
    }


def _features(rank, world):
    mesh = spmd.make_mesh({"fsdp": 2, "tp": 2})
    rules = spmd.Rules.default(sequence_parallel=True)
    tokens, targets = global_batch(0)
    x, y = local_slice(tokens, mesh), local_slice(targets, mesh)

    plain = spmd.parallelize(tiny_model(), mesh, rules)
    plain(x, y).backward()
    reference = _grads(plain)

    # bucket=False: every parameter moves on its own; the same gradients and bytes, in more collectives
    unbucketed, bucketed = CollectiveRecorder(mesh), CollectiveRecorder(mesh)
    one_by_one = spmd.parallelize(tiny_model(), mesh, rules, bucket=False)
    by_block = spmd.parallelize(tiny_model(), mesh, rules)  # outside the recorder: its agreement check communicates
    with unbucketed:
        one_by_one(x, y).backward()
    with bucketed:
        by_block(x, y).backward()
    for name, g in _grads(one_by_one).items():
        assert norm_rel_err(g, reference[name]) <= 1e-6, name
    # the same bytes, less the backward regathers of the parameters outside the blocks (the root unit keeps them)
    root_regather = sum(
        c.bytes
        for c in unbucketed.records
        if c.kind == "all_gather"
        and c.phase == "backward"
        and c.axes == ("fsdp",)
        and not c.module.startswith("layers.")
    )
    assert root_regather > 0
    assert sum(c.bytes for c in bucketed.records) == sum(c.bytes for c in unbucketed.records) - root_regather
    # units: each block and the root (embedding, final norm, output). One forward all-gather per unit, a
    # regather per block only (the root stays gathered); the gradients one reduce-scatter completes share
    # one buffer across units, and the sequence-parallel norms' (partial over fsdp and tp) another across
    # units: reduce-scattered over fsdp, then their shards all-reduced over tp once
    units, fsdp = len(by_block.layers) + 1, [c for c in bucketed.records if c.axes == ("fsdp",)]
    assert len([c for c in fsdp if c.kind == "all_gather" and c.phase == "forward"]) == units
    assert len([c for c in fsdp if c.kind == "all_gather" and c.phase == "backward"]) == units - 1
    assert len([c for c in fsdp if c.kind == "reduce_scatter"]) == 2
    norms = [c for c in bucketed.records if c.kind == "all_reduce" and "gradients" in c.reason]
    assert [c.axes for c in norms] == [("tp",)], norms
    assert len(bucketed.records) < len(unbucketed.records)

    # activation checkpointing: recomputation regathers and replays the moves; gradients are unchanged
    ckpt = tiny_model()
    assert spmd.apply_activation_checkpointing(ckpt, "full") == [0, 1]
    spmd.parallelize(ckpt, mesh, rules)
    ckpt(x, y).backward()
    for name, g in _grads(ckpt).items():
        assert norm_rel_err(g, reference[name]) <= 1e-6, name

    # two micro-batches, the first under no_sync: one gradient reduction, same gradients as one batch
    accum = spmd.parallelize(tiny_model(), mesh, rules)
    half = x.shape[0] // 2
    recorder = CollectiveRecorder(mesh)
    with spmd.no_sync(accum), recorder:
        (accum(x[:half], y[:half]) / 2).backward()
    assert not [c for c in recorder.records if "gradient" in c.reason]
    recorder = CollectiveRecorder(mesh)
    with recorder:
        (accum(x[half:], y[half:]) / 2).backward()
    # the gradients one reduce-scatter completes reduce in one buffer spanning every unit, the norms' in another
    reasons = [c.reason.split(" (")[0] for c in recorder.records if "gradient" in c.reason]
    units = ", ".join(["Llama", "layers.0", "layers.1"])
    assert sorted(reasons) == sorted(
        [f"all-reduce gradients of {units}"] + [f"reduce-scatter gradients of {units}"] * 2
    )
    for name, p in accum.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements)
        assert norm_rel_err(p.grad.full_tensor(), reference[name]) <= 1e-5, name

    # a model built on the meta device, each rank initialising only its shards: every parameter and buffer
    # equals the one-device build (same seed), bit for bit
    from models.llama import Llama

    with torch.device("meta"):
        meta = Llama(tiny_model().cfg)
    with pytest.raises(ValueError, match="meta device; pass parallelize\\(..., param_init=fn\\)"):
        spmd.parallelize(meta, mesh, rules)
    spmd.parallelize(meta, mesh, rules, param_init=meta.initializer(0))
    one_device = tiny_model(seed=0)
    one = dict([*one_device.named_parameters(), *one_device.named_buffers()])
    for name, t in [*meta.named_parameters(), *meta.named_buffers()]:
        assert torch.equal(t.full_tensor(), one[name].detach()), name

    # a module annotated from outside by a table of name patterns matches its one-device run
    torch.manual_seed(0)
    hf = HFStyleMLP()
    ref = HFStyleMLP()
    ref.load_state_dict(hf.state_dict())
    spmd.annotate_by_name(
        hf, {"up_proj.weight": ("mlp", "embed"), "down_proj.weight": ("embed", "mlp"), "down_proj.bias": ("embed",)}
    )
    spmd.parallelize(hf, mesh, rules, input_axes=("batch", None))
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    loss = hf(local_slice(data, mesh))
    ref_loss = ref(data)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    assert hf.up_proj.bias.placements[mesh.mesh_dim_names.index("tp")].is_shard()  # bias followed its weight
    for name, g in _grads(hf).items():
        assert norm_rel_err(g, dict(ref.named_parameters())[name].grad) <= 1e-5, name


@pytest.mark.slow
def test_checkpointing_accumulation_meta_init_and_outside_annotations_match_plain_runs():
    run_distributed(_features, 4, timeout_s=240)


def test_activation_checkpointing_keeps_gradients_on_one_device():
    model, ckpt = tiny_model(), tiny_model()
    spmd.apply_activation_checkpointing(ckpt, "selective:2")
    tokens, targets = global_batch(0)
    model(tokens, targets).backward()
    ckpt(tokens, targets).backward()
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match="selective:N with N >= 1"):
        spmd.apply_activation_checkpointing(tiny_model(), "selective:0")


def test_pinned_weight_is_kept_and_its_conflict_reported():
    model = tiny_model()
    spmd.annotate(model.layers[0].feed_forward.w1.weight, spmd.P("fsdp", None))
    plan = spmd.explain(model, spmd.Rules.default(), {"fsdp": 2}, batch_shape=(4 * BATCH, SEQ))
    [decision] = [d for d in plan.decisions if d.module == "layers.0.feed_forward.w1"]
    assert decision.choice == "gather weight" and decision.weight_bytes < decision.activation_bytes
    assert "layers.0.feed_forward.w1: gather weight over fsdp" in plan.table().replace("layers.*", "layers.0")
    # small activations: gathering the activation is cheaper, and the pass says so
    small = spmd.explain(model, spmd.Rules.default(), {"fsdp": 2}, batch_shape=(2, 4))
    [decision] = [d for d in small.decisions if d.module == "layers.0.feed_forward.w1"]
    assert decision.choice == "gather activation" and decision.activation_bytes <= decision.weight_bytes
