"""The stage splitter, the pipeline's input checks and explain's pipeline section: no processes needed."""

import itertools
import random

import pytest
import torch
import torch.nn as nn

import spmd
from models.llama import Llama, LlamaConfig
from spmd.pipeline import bubble_fraction, validate_pipeline
from spmd.pipeline.split import min_max_partition, stage_ranks


def _llama(n_layers=8, **kw):
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny", kernels="torch", n_layers=n_layers, **kw))


def _brute_force(costs, parts, first, last):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = (0, *cuts, len(costs))
        runs = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        runs[0] += first
        runs[-1] += last
        best = max(runs) if best is None else min(best, max(runs))
    return best


def test_partition_is_the_exact_min_max():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.randint(1, 20) for _ in range(n)]
        first, last = rng.randint(0, 30), rng.randint(0, 30)
        runs = min_max_partition(costs, parts, first, last)
        assert [i for run in runs for i in run] == list(range(n)) and all(runs)
        got = [sum(costs[i] for i in run) for run in runs]
        got[0] += first
        got[-1] += last
        assert max(got) == _brute_force(costs, parts, first, last), (costs, parts, first, last, runs)
    # ties go to the most even cut
    assert min_max_partition([1] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_split_counts_embedding_first_and_head_last():
    model = _llama(8)
    total = sum(p.numel() for p in model.parameters())
    for cost in ("params", "flops"):
        split = spmd.split_stages(model, 4, cost=cost)
        assert [s.blocks for s in split.stages] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert split.pre == ["tok_embeddings"] and split.post == ["norm", "output"]
        assert sum(s.params for s in split.stages) == total
        embed, head = model.tok_embeddings.weight.numel(), model.norm.weight.numel() + model.output.weight.numel()
        assert split.stages[0].params - split.stages[1].params == embed
        assert split.stages[3].params - split.stages[1].params == head
        assert split.stages[-1].flops > split.stages[1].flops > 0  # the head's matmul is on the last stage
        assert split.imbalance() == pytest.approx(
            max(getattr(s, cost) for s in split.stages) / (sum(getattr(s, cost) for s in split.stages) / 4)
        )
    # a head as large as three blocks pushes blocks off the last stage
    wide = _llama(8, vocab_size=4096)
    split = spmd.split_stages(wide, 4, cost="params")
    assert len(split.stages[-1].blocks) < 2 and len(split.stages[0].blocks) < 2


def test_virtual_stages_are_placed_round_robin_or_in_a_v():
    model = _llama(8)
    loop = spmd.split_stages(model, 4, cost="params", pp=2)
    assert [s.rank for s in loop.stages] == [0, 1, 0, 1] and loop.virtual_stages == 2
    v = spmd.split_stages(model, 4, cost="params", pp=2, style="v")
    assert [s.rank for s in v.stages] == [0, 1, 1, 0]
    assert stage_ranks(8, 4, "v") == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="exactly 2 stages"):
        stage_ranks(6, 2, "v")


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)])


def test_models_the_splitter_cannot_split_say_why():
    with pytest.raises(ValueError, match="no nn.ModuleList of identical blocks"):
        spmd.split_stages(_NoBlocks(), 2, cost="params")
    with pytest.raises(ValueError, match="different types"):
        spmd.split_stages(_Mixed(), 2, cost="params", blocks="layers")
    with pytest.raises(ValueError, match="has 2 blocks .* each stage needs at least one"):
        spmd.split_stages(_llama(2), 4, cost="params")
    with pytest.raises(ValueError, match="split cost must be one of"):
        spmd.split_stages(_llama(2), 2, cost="time")


def test_bad_pipeline_configurations_fail_before_any_collective():
    validate_pipeline(2, "1f1b", 4, 1, n_blocks=4, batch_size=8, data_parallel=2)
    cases = [
        (dict(pp=2, schedule="1f2b", microbatches=4), "unknown pipeline schedule '1f2b'"),
        (dict(pp=1, schedule="1f1b", microbatches=4), "needs pp >= 2"),
        (dict(pp=3, schedule="1f1b", microbatches=4, world=8), "does not divide the world size 8"),
        (dict(pp=2, schedule="interleaved-1f1b", microbatches=3, virtual_stages=2), "multiple of pp"),
        (dict(pp=4, schedule="zero-bubble", microbatches=6, virtual_stages=2), "multiple of pp"),
        (dict(pp=2, schedule="1f1b", microbatches=4, virtual_stages=2), "runs one stage per rank"),
        (dict(pp=2, schedule="zbv", microbatches=4, virtual_stages=3), "use virtual_stages=2"),
        (dict(pp=4, schedule="1f1b", microbatches=2), "at least as many micro-batches as stages"),
        (
            dict(pp=4, schedule="interleaved-1f1b", microbatches=4, virtual_stages=2, n_blocks=6),
            "8 stages but the model has only 6 blocks",
        ),
        (dict(pp=2, schedule="gpipe", microbatches=3, batch_size=8, data_parallel=2), "multiple of 6"),
        (dict(pp=2, schedule="gpipe", microbatches=0), "positive integer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_pipeline(**kwargs)


def test_bubble_formulas():
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 11 / 2)
    assert bubble_fraction("zero-bubble", 4, 8, 1) == pytest.approx(3 / 27)


def test_explain_reports_the_pipeline_on_a_fake_world():
    model = _llama(4)
    rules = spmd.Rules.default(sequence_parallel=True)
    plan = spmd.explain(
        model,
        rules,
        {"pp": 2, "fsdp": 2, "tp": 2},
        batch_shape=(16, 32),
        schedule="interleaved-1f1b",
        microbatches=4,
        virtual_stages=2,
        split_cost="params",
    )
    p = plan.pipeline
    assert (p["pp"], p["microbatches"], p["virtual_stages"]) == (2, 4, 2)
    assert p["bubble"] == pytest.approx(1 / 5 / 2)
    assert [s["rank"] for s in p["stages"]] == [0, 1, 0, 1]
    assert [s["blocks"] for s in p["stages"]] == [[i, i] for i in range(4)]
    # a micro-batch of 16/4 = 4 sequences over fsdp=2, sequence-parallel over tp=2, fp32
    assert p["activation_shape"] == [2, 16, 64]
    assert p["send_recv_bytes_per_microbatch"] == 2 * 16 * 64 * 4
    sends = [c for c in plan.collectives if c.kind in ("send", "recv")]
    rank = p["reported_rank"]
    stages = [s for s in p["stages"] if s["rank"] == rank]
    boundaries = sum((not s["first"]) + (not s["last"]) for s in stages)  # neighbours are on the other rank
    assert len(sends) == 2 * 4 * boundaries and {c.axes for c in sends} == {("pp",)}
    assert {c.bytes for c in sends} == {p["send_recv_bytes_per_microbatch"]}
    # the reported rank holds its stages' parameters, sharded over fsdp (norms) or fsdp x tp (the rest)
    params = sum(s["params"] for s in stages)
    assert params * 4 / 4 <= plan.memory["parameters"] <= params * 4 / 2
    assert p["imbalance"] == pytest.approx(
        max(s["params"] for s in p["stages"]) / (sum(s["params"] for s in p["stages"]) / 4)
    )
    table = plan.table()
    assert (
        "pipeline: interleaved-1f1b, pp=2, 4 micro-batches, 2 virtual stages per rank; theoretical bubble "
        "10.0%" in table
    )
    again = spmd.Plan.from_dict(plan.to_dict())
    assert again.pipeline == p and again.table() == table
    with pytest.raises(ValueError, match="multiple of pp"):
        spmd.explain(
            model, rules, {"pp": 4}, batch_shape=(16, 32), schedule="interleaved-1f1b", microbatches=6, virtual_stages=1
        )


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))


class _Logits(_Plain):
    def forward(self, tokens, targets=None):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return h


def test_models_build_pipeline_cannot_stage_say_why():
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=4)
    try:
        mesh = spmd.make_mesh({"pp": 2, "fsdp": 2}, device_type="cpu")
        rules = spmd.Rules.default()
        with pytest.raises(
            ValueError,
            match=r"cannot cut _Plain into pipeline stages: its forward failed on "
            r"shapes alone \(NotImplementedError.*loss_fn",
        ):
            spmd.build_pipeline(_Plain(), mesh, rules)
        with pytest.raises(ValueError, match=r"output \(\w*Tensor\) holds no scalar loss .*build_pipeline\(loss_fn="):
            spmd.build_pipeline(_Logits(), mesh, rules)
        from tests.nanogpt import GPT, GPTConfig

        with pytest.raises(
            ValueError, match=r"uses \['wte.weight'\] both before and after its blocks .*other than zbv"
        ):
            spmd.build_pipeline(
                GPT(GPTConfig(n_layer=4)), mesh, rules, schedule="zbv", virtual_stages=2, microbatches=4
            )
        with pytest.raises(ValueError, match=r"cannot be laid out over \{'fsdp': 2\}.*module hooks"):
            spmd.build_traced_pipeline(_Plain(), mesh, (torch.zeros(1, 4, dtype=torch.long),), None)
        with pytest.raises(ValueError, match="shared by pipeline stages 0 and 1 .*tied"):
            spmd.build_pipeline(_llama(4, tie_embeddings=True), mesh, rules)
        with pytest.raises(ValueError, match="multiple of pp"):
            spmd.build_pipeline(_llama(4), mesh, rules, schedule="zero-bubble", microbatches=3, virtual_stages=2)
    finally:
        dist.destroy_process_group()
