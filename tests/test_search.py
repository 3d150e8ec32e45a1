"""spmd.search: enumerates the specs of a world size, plans them exactly (block extrapolation = full explain),
drops what does not fit, ranks the rest by the stated step-time model."""

import importlib
import math
import os

import pytest
import torch

import models
import spmd
from models.llama import Llama, LlamaConfig
from spmd.analysis import derived, search_rounds, summaries
from spmd.analysis.devices import DEVICES, Device
from spmd.analysis.search import ac_modes

S = importlib.import_module("spmd.analysis.search")  # the module; the attribute spmd.search is the function


def tiny(**overrides):
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny", kernels="torch", **overrides))


def test_candidates_cover_every_factorisation_once():
    cands = S.candidate_specs(8, max_tp=8)
    names = [S.spec_name(s, sp) for s, sp in cands]
    assert len(names) == len(set(names))
    assert all(math.prod(s.values()) == 8 for s, _ in cands)
    # (dp, fsdp, tp) with product 8: 10 triples, 6 of them with tp > 1 get an sp twin
    assert len(cands) == 10 + 6
    assert "tp=8,sp" in names and "dp=2,fsdp=2,tp=2" in names and "fsdp=8" in names
    assert all(s.get("tp", 1) <= 4 for s, _ in S.candidate_specs(16, max_tp=4))


def test_links_put_inner_axes_inside_a_node():
    assert S.links({"dp": 8, "fsdp": 4, "tp": 2}, 8) == {"dp": "inter", "fsdp": "intra", "tp": "intra"}
    assert S.links({"fsdp": 16, "tp": 4}, 8) == {"fsdp": "inter", "tp": "intra"}
    assert S.links({"dp": 2, "fsdp": 4}, 8) == {"dp": "intra", "fsdp": "intra"}  # world fits in one node


def test_block_extrapolation_equals_the_full_plan():
    model = tiny(n_layers=4)
    for spec in ("fsdp=2,tp=2,sp", "dp=2,tp=2"):
        sizes, flags = spmd.parse_spec(spec)
        full = summaries.summarize(spmd.explain(model, spmd.Rules.default("sp" in flags), sizes, batch_shape=(8, 16)))
        summaries._cache.clear()
        fast = summaries.plan_summary(model, sizes, "sp" in flags, (8, 16), "fp32")
        assert {k: v for k, v in fast.groups.items() if v[0]} == full.groups
        assert fast.memory == full.memory


def test_full_checkpointing_derived_from_a_1_block_copy_equals_explain():
    """The search plans full checkpointing from the plan without it and one dry run of a 1-block copy
    (spmd/analysis/derived.py); on a sample of specs (ZeRO 3 in bf16 with its prefetched regathers and sp,
    ZeRO 2 at two micro-batches with the cp ring) that plan equals explain's of the whole 3-block model under `full`:
    every collective group (count, bytes, ring steps) and every memory figure. Mutations it kills:
    full_from_none without `regathered` (regathers stay prefetched), or without the 1-block copy's change
    (`block = regathered(none.block)`)."""
    model = tiny(n_layers=3)
    for spec, zero, k, dtype in (("fsdp=2,tp=2,sp", 3, 1, "bf16"), ("fsdp=2,cp=2", 2, 2, "fp32")):
        sizes, flags = spmd.parse_spec(spec)
        rules = summaries.rules_for("sp" in flags, zero)
        plan = spmd.explain(model, rules, sizes, batch_shape=(8, 16), dtype=dtype, ac="full", grad_accum=k)
        full = summaries.summarize(plan)
        summaries._cache.clear()
        args = (model, sizes, "sp" in flags, (8, 16), dtype, rules)
        none = summaries.planned(*args, "none", k, block=True)
        fast = derived.full_from_none(none, summaries.planned(*args, "full", k, block=summaries.ONE_BLOCK))
        assert {g: v for g, v in fast.groups.items() if v[0]} == full.groups, spec
        assert fast.memory == full.memory, spec


def test_zero2_derived_from_zero1_and_zero3_equals_explain():
    """The search plans ZeRO 2 from the same mesh's ZeRO 1 and ZeRO 3 plans (derived.zero2_from: ZeRO 1's with
    ZeRO 3's gradient reductions and gradient bytes). On a sample of specs (tp with sp in bf16; dp x fsdp under
    full checkpointing at two micro-batches, gradients held unreduced) it equals explain's dry run of the whole
    3-block model at ZeRO 2: every collective group (count, bytes, ring steps) and every memory figure, and the
    derived block share extrapolates to it. Mutations it kills: zero2_from keeping ZeRO 1's reductions (one
    reduce-scatter in the step) or ZeRO 1's gradient bytes."""
    model = tiny(n_layers=3)
    for spec, ac, k, dtype in (("fsdp=2,tp=2,sp", "none", 1, "bf16"), ("dp=2,fsdp=2", "full", 2, "fp32")):
        sizes, flags = spmd.parse_spec(spec)
        sp = "sp" in flags
        plan = spmd.explain(
            model, summaries.rules_for(sp, 2), sizes, batch_shape=(8, 16), dtype=dtype, ac=ac, grad_accum=k
        )
        want = summaries.summarize(plan)
        summaries._cache.clear()
        z1, z3 = (
            summaries.planned(model, sizes, sp, (8, 16), dtype, summaries.rules_for(sp, z), ac, k, True) for z in (1, 3)
        )
        got = derived.zero2_from(z1, z3)
        assert {g: v for g, v in got.groups.items() if v[0]} == want.groups, spec
        assert got.memory == want.memory, spec
        dry = summaries.planned(model, sizes, sp, (8, 16), dtype, summaries.rules_for(sp, 2), ac, k, True)
        assert derived.same_plan(got.block, dry.block), spec  # what selective checkpointing composes from


def test_blocks_sharing_an_outside_tensor_are_planned_from_both_copies():
    """A Hugging Face Llama's blocks all take the rotary cos/sin its model makes: saved once without
    checkpointing, once per checkpointed block with it, so derived.full_from_none undercounts its activations.
    The search checks the derivation on its first spec and plans such a model from the 1- and 2-block copies:
    its plan under `full` equals explain's. Mutation it kills: _plan_full returning the derived plans unchecked."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    spmd.annotate_hf(model)
    sizes, key, rules = {"fsdp": 2, "tp": 2}, ((("fsdp", 2), ("tp", 2)), True, 3), summaries.rules_for(True, 3)
    full = summaries.summarize(spmd.explain(model, rules, sizes, batch_shape=(8, 16), dtype="bf16", ac="full"))
    args = (model, sizes, True, (8, 16), "bf16", rules)
    nones = {key: summaries.planned(*args, "none", 1, block=True)}
    derived_full = derived.full_from_none(nones[key], summaries.planned(*args, "full", 1, block=summaries.ONE_BLOCK))
    assert derived_full.memory["activations"] < full.memory["activations"]
    fulls = search_rounds._plan_full(model, {key: [1]}, nones, (8, 16, "bf16"), (None, S.Progress(False)))
    assert fulls[key].memory == full.memory
    assert {g: v for g, v in fulls[key].groups.items() if v[0]} == full.groups


def test_a_mixture_of_experts_is_searched_over_ep_dividing_its_experts():
    """ep joins the candidates only for a model with experts, and only where it divides them; an MoE plan
    (all-to-alls at balanced routing, expert parameters per rank) extrapolates from 1 and 2 blocks exactly."""
    dense = [S.spec_name(s, sp) for s, sp in S.candidate_specs(8)]
    moe = [S.spec_name(s, sp) for s, sp in S.candidate_specs(8, experts=4)]
    assert not any("ep=" in n for n in dense) and set(dense) < set(moe) and len(moe) == len(set(moe))
    assert {"ep=4,tp=2", "fsdp=2,ep=4", "dp=2,fsdp=2,ep=2", "ep=2,tp=4,sp"} <= set(moe)
    assert not any("ep=8" in n for n in moe) and all(
        math.prod(s.values()) == 8 for s, _ in S.candidate_specs(8, experts=4)
    )
    torch.manual_seed(0)
    cfg = models.preset("moe-tiny", kernels="torch", n_layers=3)
    model, sizes = cfg.build(), {"fsdp": 2, "ep": 2}
    full = summaries.summarize(spmd.explain(model, spmd.Rules.default(), sizes, batch_shape=(8, 16)))
    summaries._cache.clear()
    fast = summaries.plan_summary(model, sizes, False, (8, 16), "fp32")
    assert {k: v for k, v in fast.groups.items() if v[0]} == full.groups and fast.memory == full.memory
    assert fast.memory["expert_parameters"] == 3 * cfg.n_experts // 2 * 3 * cfg.expert_dim * cfg.dim * 4 // 2


def test_model_state_floor_matches_explain():
    model = tiny()
    for spec, zero in (("fsdp=4", 3), ("fsdp=4", 2), ("dp=2,fsdp=2", 1), ("tp=2,dp=2", 3), ("dp=4", 3)):
        sizes, flags = spmd.parse_spec(spec)
        rules = spmd.Rules.default(zero=zero)
        plan = spmd.explain(model, rules, sizes, batch_shape=(8, 16))
        want = plan.memory["parameters"] + plan.memory["gradients"] + plan.memory["optimizer"]
        assert S.model_state_bytes(model, sizes, rules) == want, (spec, zero)


@pytest.fixture(scope="module")
def tiny_search():
    dev = DEVICES["h100"]
    return S.search(tiny(), 4, device=dev, batch_shape=(8, 32), dtype="fp32", zero=3)


def test_search_ranks_every_spec_by_predicted_step_time(tiny_search):
    rows = tiny_search
    assert len(rows) + len(rows.dropped) == 9
    assert not rows.dropped
    times = [r.step_s for r in rows]
    assert times == sorted(times)
    for r in rows:
        assert r.step_s == pytest.approx(r.compute_s + r.activation_comm_s + r.param_comm_s - r.hidden_s)
        assert (r.ac, r.grad_accum, r.recompute_s) == ("none", 1, 0.0)  # everything fits without either
        assert r.memory["total"] > 0 and r.comm_bytes > 0
    # the tiny model is latency-bound: the spec with the fewest collectives issues them fastest
    assert rows[0].collectives == min(r.collectives for r in rows)
    print(rows.table())


def test_search_drops_what_does_not_fit(tiny_search):
    # a budget between the smallest and the largest plan
    mems = sorted(r.memory["total"] for r in tiny_search)
    budget = (mems[0] + mems[-1]) / 2
    rows = S.search(
        tiny(),
        4,
        device="h100",
        batch_shape=(8, 32),
        dtype="fp32",
        memory_budget_bytes=budget,
        ac="none",
        grad_accum=1,
        zero=3,
    )
    assert rows and rows.dropped
    assert all(r.memory["total"] <= budget for r in rows)
    assert all(not r.fits and "budget" in r.note for r in rows.dropped)
    assert {r.spec for r in rows} | {r.spec for r in rows.dropped} == {r.spec for r in tiny_search}
    assert "dropped:" in rows.table()


def test_specs_that_do_not_divide_are_dropped_with_the_reason():
    rows = spmd.search(tiny(), 8, device="h100", batch_shape=(8, 32), dtype="fp32", specs=["tp=8", "fsdp=8"])
    assert sorted((r.spec, r.zero) for r in rows) == [("fsdp=8", z) for z in (1, 2, 3)]
    assert "4 key/value heads, which do not split over tp=8" in rows.dropped[0].note
    # a spec that does not divide for another reason: explain's error names it
    rows = spmd.search(tiny(), 8, device="h100", batch_shape=(4, 32), dtype="fp32", specs=["dp=8", "tp=4,dp=2"])
    assert [r.spec for r in rows] == ["dp=2,tp=4"] and "does not lay out" in rows.dropped[0].note


def test_only_prefetched_gathers_hide_and_bandwidth_matters():
    model = tiny()
    slow = Device(
        "slow", {"fp32": 1e9}, 1e12, intra_bw=1e6, inter_bw=1e6, intra_latency=0, inter_latency=0, efficiency=1.0
    )
    rows = {
        r.spec: r
        for r in S.search(model, 4, device=slow, batch_shape=(8, 32), dtype="fp32", zero=3, specs=["fsdp=4", "tp=4"])
    }
    plan = spmd.explain(model, spmd.Rules.default(), {"fsdp": 4}, batch_shape=(8, 32))
    ahead = {
        ph: sum(c.bytes for c in plan.collectives if c.phase == ph and "prefetched" in c.reason) / 1e6
        for ph in ("forward", "backward")
    }  # seconds on the 1 MB/s link
    compute = rows["fsdp=4"].compute_s
    assert ahead["forward"] > 0 and ahead["backward"] > 0
    assert rows["fsdp=4"].hidden_s == pytest.approx(
        min(ahead["forward"], compute / 3) + min(ahead["backward"], 2 * compute / 3)
    )
    assert rows["tp=4"].hidden_s == 0  # tensor-parallel traffic is on the critical path
    # bandwidth-bound: bytes decide; fsdp moves more bytes than tp for this model and batch
    b = rows
    assert (b["fsdp=4"].comm_bytes > b["tp=4"].comm_bytes) == (b["fsdp=4"].step_s > b["tp=4"].step_s)


def test_latency_counts_ring_steps_of_each_collective():
    # a latency-bound link: 1 ms per collective and 10 ms per ring step, bytes free, compute free
    model = tiny()
    link = Device(
        "steps",
        {"fp32": 1e30},
        1e12,
        intra_bw=1e30,
        inter_bw=1e30,
        intra_latency=1e-3,
        inter_latency=1e-3,
        intra_step_latency=1e-2,
        inter_step_latency=1e-2,
        overlaps_comm=False,
    )
    rows = {
        r.spec: r
        for r in S.search(
            model,
            4,
            device=link,
            batch_shape=(8, 32),
            dtype="fp32",
            zero=3,
            specs=["tp=4", "dp=2,tp=2", "fsdp=2,tp=2,sp"],
        )
    }
    for spec, row in rows.items():
        sizes, sp = spmd.parse_spec(spec)
        plan = spmd.explain(model, spmd.Rules.default(sequence_parallel=sp), sizes, batch_shape=(8, 32))
        # the textbook rounds: an all-reduce over n ranks is 2(n-1) messages in a row, an all-gather or a
        # reduce-scatter n-1
        rounds = sum(
            {"all_reduce": 2}.get(c.kind, 1) * (math.prod(sizes.get(a, 1) for a in c.axes) - 1)
            for c in plan.collectives
        )
        assert row.collectives == len(plan.collectives)
        assert row.step_s == pytest.approx(1e-3 * len(plan.collectives) + 1e-2 * rounds, rel=1e-6)
    # tp=4's all-reduces span 4 ranks: fewer collectives than dp=2,tp=2's, more rounds, a slower step
    assert rows["tp=4"].collectives < rows["dp=2,tp=2"].collectives and rows["tp=4"].step_s > rows["dp=2,tp=2"].step_s


def test_an_oversubscribed_cpu_hides_no_collective():
    from spmd.analysis.devices import cpu_device

    cores = os.cpu_count()
    assert cpu_device(cores, 1, 1e9).overlaps_comm and not cpu_device(cores + 1, 1, 1e9).overlaps_comm
    busy = cpu_device(4, cores, 1e9)  # 4 ranks of `cores` threads each: more threads than cores
    rows = {
        d.overlaps_comm: S.search(tiny(), 4, device=d, batch_shape=(8, 32), dtype="fp32", zero=3, specs=["fsdp=4"])[0]
        for d in (busy, busy.replace(overlaps_comm=True))
    }
    assert rows[True].hidden_s > 0 and rows[False].hidden_s == 0
    assert rows[False].step_s == pytest.approx(
        rows[False].compute_s + rows[False].activation_comm_s + rows[False].param_comm_s
    )


SPEC, SIZES, SHAPE = "fsdp=2,tp=2,sp", {"fsdp": 2, "tp": 2}, (8, 16)  # the next three tests share their plans


def test_selective_checkpointing_composed_from_none_and_full_equals_explain():
    model, rules = tiny(n_layers=4), spmd.Rules.default(True)
    plain = summaries.plan_summary(model, SIZES, True, SHAPE, "fp32").block  # one block without checkpointing
    for ac in ("selective:3",):  # blocks 0 and 3 checkpointed: 1 and 2 plain, only 1's regather prefetched
        want = summaries.summarize(spmd.explain(model, rules, SIZES, batch_shape=SHAPE, ac=ac))
        got = summaries.plan_summary(model, SIZES, True, SHAPE, "fp32", ac=ac)
        assert {k: v for k, v in got.groups.items() if v[0]} == want.groups
        recompute = plain.memory["activations"]
        assert got.memory == {**want.memory, "recompute": recompute, "total": want.memory["total"] + recompute}
    assert ac_modes(5) == ["none", "selective:5", "selective:3", "selective:2", "full"]
    assert ac_modes(4) == ["none", "selective:4", "selective:2", "full"]


def test_micro_batches_repeat_all_but_the_reductions():
    """search's model of --grad-accum 3 (two planned micro-batches, scaled) equals explain's dry run of the
    trainer's loop: three forward/backward passes, the first two under no_sync."""
    model, rules = tiny(), spmd.Rules.default(True)
    two = summaries.planned(model, SIZES, True, SHAPE, "fp32", rules, "none", 2)  # 2 x 4 sequences
    three = spmd.explain(model, rules, SIZES, batch_shape=(12, 16), grad_accum=3)  # 3 x 4 sequences
    got = summaries.accumulated(two, 2, 3)
    assert {k: v for k, v in got.groups.items() if v[0]} == summaries.summarize(three).groups
    assert got.memory == summaries.summarize(three).memory
    assert any(k[1] == "reduce" for k in got.groups)  # ... which ran once
    # FSDP: the gradients wait unreduced, gathered over fsdp, more than their shards (= the parameters' bytes)
    assert three.memory["gradients"] > three.memory["parameters"]


def test_each_row_equals_explain_of_its_flags():
    """The search's fast path (1- and 2-block copies, full checkpointing and ZeRO 2 derived, selective
    checkpointing composed, micro-batches scaled from two) against the full `explain` of every row's flags
    (mesh, ZeRO stage, --ac, --grad-accum) on a sample of specs, with a budget that makes rows checkpoint,
    take micro-batches or drop: the same collectives (count and bytes) and memory, plus the one block
    backward rebuilds at a time. Mutations it kills: gradient reductions repeated per micro-batch
    (summaries.accumulated), a lone plain block's regather left prefetched (summaries.checkpointed)."""
    model = tiny(n_layers=4)
    budget = summaries.plan_summary(model, SIZES, True, SHAPE, "fp32", ac="selective:2").memory["total"]
    ask = dict(batch_shape=SHAPE, dtype="fp32")
    tight = S.search(model, 4, memory_budget_bytes=budget, specs=[SPEC], **ask)  # each ZeRO stage its own fit
    ample = S.search(model, 4, specs=["dp=2,fsdp=2"], **ask)
    pinned = S.search(model, 4, specs=["fsdp=2,tp=2"], ac="full", grad_accum=4, zero=1, **ask)
    compared = [r for r in [*tight, *tight.dropped, *ample, *pinned] if r.memory.get("activations")]
    assert {(r.ac, r.grad_accum) for r in compared} >= {("none", 1), ("selective:2", 1), ("full", 2), ("full", 4)}
    assert {r.zero for r in compared} >= {1, 2, 3} and len(compared) >= 7
    for row in compared:
        rules = summaries.rules_for(row.sp, row.zero)
        plan = spmd.explain(model, rules, row.sizes, batch_shape=SHAPE, ac=row.ac, grad_accum=row.grad_accum)
        want = summaries.summarize(plan)
        assert (row.collectives, row.comm_bytes) == tuple(map(sum, zip(*want.groups.values())))[:2], row.flags
        if row.ac == "none":
            assert row.memory == want.memory, row.flags
        else:
            recompute = row.memory["recompute"]
            assert row.memory == {**want.memory, "recompute": recompute, "total": want.memory["total"] + recompute}


def test_the_full_checkpointing_check_is_planned_within_its_round(monkeypatch):
    """The once-per-model check of derived.full_from_none (the lightest spec's 1- and 2-block copies under
    `full`) is planned in the same plan_all as the round's 1-block copies, so that workers plan it beside them
    rather than after them; once it held, a round plans the 1-block copies alone. Mutation it kills: the check
    planned after the round (a second plan_all)."""
    from spmd.analysis import search_pool

    model = tiny(n_layers=4)
    for key in [k for k in summaries._cache if k[0] == "full_from_none holds"]:
        del summaries._cache[key]
    keys = [((("fsdp", 2), ("tp", 2)), True, 3), ((("dp", 4),), False, None)]
    nones = {
        k: summaries.planned(model, dict(k[0]), k[1], SHAPE, "fp32", summaries.rules_for(k[1], k[2]), "none", 1)
        for k in keys
    }
    calls = []
    plan_all = search_rounds.plan_all
    monkeypatch.setattr(search_rounds, "plan_all", lambda net, jobs, *a: calls.append(jobs) or plan_all(net, jobs, *a))
    for _ in range(2):
        search_rounds._plan_full(model, {k: [1] for k in keys}, nones, (*SHAPE, "fp32"), (None, S.Progress(False)))
    assert search_pool.verdict(model, "full_from_none") is True
    assert [sorted({job[-1] for job in jobs}, key=str) for jobs in calls] == [
        ["1-block copy", True],
        ["1-block copy"],
    ]


def test_search_assumes_the_least_recompute_then_the_fewest_micro_batches_that_fit():
    model = tiny(n_layers=4)
    total = lambda sizes, sp, ac: summaries.plan_summary(model, sizes, sp, SHAPE, "fp32", ac=ac).memory["total"]  # noqa
    ask = dict(device="h100", batch_shape=SHAPE, dtype="fp32", zero=3)
    row = S.search(model, 4, memory_budget_bytes=total(SIZES, True, "selective:2"), specs=[SPEC], **ask)[0]
    assert (row.ac, row.grad_accum) == ("selective:2", 1)
    assert total(SIZES, True, "selective:4") > total(SIZES, True, "selective:2")
    assert row.recompute_s == pytest.approx(row.compute_s / 3 * 2 / 4)  # 2 of 4 blocks run forward again
    assert row.flags == "--mesh fsdp=2,tp=2,sp --zero 3 --ac selective:2 --grad-accum 1"
    dropped = S.search(
        model, 4, memory_budget_bytes=total(SIZES, True, "full") - 1, specs=[SPEC], ac="full", grad_accum=1, **ask
    ).dropped
    assert "even with --ac full --grad-accum 1" in dropped[0].note
    # replicated parameters (dp) hold their whole gradients anyway: a second micro-batch halves activations
    budget = total({"dp": 4}, False, "full") - 1
    row = S.search(model, 4, memory_budget_bytes=budget, specs=["dp=4"], **ask)[0]
    assert row.grad_accum == 2 and row.memory["total"] <= budget and row.flags.startswith("--mesh dp=4 --ac ")


def test_bad_checkpointing_or_micro_batches_are_named_before_planning():
    model = tiny()
    with pytest.raises(ValueError, match="grad_accum must be an integer >= 1"):
        spmd.explain(model, spmd.Rules.default(), {"fsdp": 2}, grad_accum=0)
    with pytest.raises(ValueError, match="grad_accum > 1 with a pp axis"):
        spmd.explain(model, spmd.Rules.default(), {"pp": 2, "fsdp": 2}, grad_accum=2)
    with pytest.raises(ValueError, match="grad_accum must be an integer >= 1"):
        spmd.search(model, 4, grad_accum=0)
    with pytest.raises(ValueError, match="none, full or selective:N"):
        spmd.search(model, 4, ac="some")


def test_llama_8b_on_8_h100_fits_with_activation_checkpointing():
    """The issue's case: 16 x 8192 bf16 on 8 H100s drops every spec without checkpointing."""
    from models import preset

    budget = 0.9 * 80e9
    rows = spmd.search(preset("8b"), 8, device="h100", batch_shape=(16, 8192), dtype="bf16", specs=["fsdp=8"], zero=3)
    row = rows[0]
    print(row.flags, f"{row.memory['total'] / 1e9:.1f} GB of 80 GB")
    assert row.ac != "none" and row.grad_accum in (1, 2) and row.memory["total"] <= budget
    assert row.memory["activations"] + row.memory["recompute"] < 20e9  # without: over 100 GB
    assert row.recompute_s > 0 and row.step_s > row.compute_s + row.recompute_s


def test_llama_70b_on_64_h100_fits_with_activation_checkpointing():
    from models import preset

    rows = spmd.search(
        preset("70b"), 64, device="h100", batch_shape=(64, 4096), dtype="bf16", specs=["fsdp=8,tp=8,sp"], zero=3
    )  # a node of tp, fsdp across the 8 nodes
    row = rows[0]
    print(row.flags, f"{row.memory['total'] / 1e9:.1f} GB of 80 GB")
    assert row.ac != "none" and row.memory["total"] <= 0.9 * 80e9


def test_each_zero_stage_of_a_mesh_with_fsdp_is_a_row_of_its_own():
    """A mesh with an fsdp axis is planned at ZeRO stages 1, 2 and 3 (each row the plan explain gives at
    that stage, its flags naming the stage); a mesh without one is one row. Where bytes decide and compute
    hides nothing, stages 1 and 2 (a reduce-scatter and an all-gather of the parameters per step) beat stage
    3 (its gathers in forward and backward too); of the two, stage 2 holds less. A budget between stage 3's
    model states and stage 2's drops stages 1 and 2 before planning them."""
    model = tiny()
    slow = Device(
        "slow", {"fp32": 1e18}, 1e12, intra_bw=1e6, inter_bw=1e6, intra_latency=0, inter_latency=0, efficiency=1.0
    )
    ask = dict(device=slow, batch_shape=(8, 32), dtype="fp32", specs=["fsdp=4", "dp=4"])
    rows = S.search(model, 4, **ask)
    by = {(r.spec, r.zero): r for r in rows}
    assert [k for k in by if k[0] == "fsdp=4"] == [("fsdp=4", 2), ("fsdp=4", 1), ("fsdp=4", 3)]
    floors = {}
    for z in (1, 2, 3):
        rules = spmd.Rules.default(zero=z)
        plan = spmd.explain(model, rules, {"fsdp": 4}, batch_shape=(8, 32))
        row = by[("fsdp=4", z)]
        assert row.memory == {k: v for k, v in plan.memory.items() if k != "peak"}  # search rows carry no peak
        assert row.comm_bytes == sum(c.bytes for c in plan.collectives if c.kind != "recv")
        assert row.flags == f"--mesh fsdp=4 --zero {z} --ac none --grad-accum 1"
        floors[z] = S.model_state_bytes(model, {"fsdp": 4}, rules)
    assert by[("dp=4", None)].flags == "--mesh dp=4 --ac none --grad-accum 1"
    assert by[("fsdp=4", 1)].comm_bytes == by[("fsdp=4", 2)].comm_bytes < by[("fsdp=4", 3)].comm_bytes
    assert by[("fsdp=4", 2)].memory["total"] < by[("fsdp=4", 1)].memory["total"]
    assert floors[3] < floors[2] < floors[1]
    short = {**ask, "batch_shape": (4, 8)}  # few activations: stage 3 fits where stage 2's states alone do not
    budget = next(r for r in S.search(model, 4, zero=3, **short) if r.spec == "fsdp=4").memory["total"]
    assert budget < floors[2]
    pinned = S.search(model, 4, memory_budget_bytes=budget, **short)
    assert [(r.spec, r.zero) for r in pinned if r.spec == "fsdp=4"] == [("fsdp=4", 3)]
    assert {r.zero for r in pinned.dropped if r.spec == "fsdp=4"} == {1, 2}
    assert all("alone need" in r.note for r in pinned.dropped if r.spec == "fsdp=4")
    assert {(r.spec, r.zero) for r in S.search(model, 4, zero=1, **ask)} == {("fsdp=4", 1), ("dp=4", None)}
    with pytest.raises(ValueError, match="zero must be a ZeRO stage"):
        S.search(model, 4, zero=4, **ask)


def test_flops_follow_design_formula():
    cfg = LlamaConfig.preset("tiny")
    assert S.flops_per_token(tiny(), 64) == 6 * cfg.num_params(non_embedding=True) + 12 * 2 * 8 * 8 * 64


def test_cli_prints_a_table(capsys):
    from spmd.search_command import search_main

    assert (
        search_main(
            ["--model", "tiny", "--world", "2", "--device", "a100", "--batch", "4", "--seq", "32", "--workers", "1"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "spec search" in out and "fsdp=2" in out and "tp=2,sp" in out
    assert "meshes planned" in err  # the progress line, naming the mesh before its dry runs start
    assert "0/" in err and "s, planning tp=2" in err
    assert "--mesh tp=2,sp --ac none --grad-accum 1" in out
    assert all(f"--mesh fsdp=2 --zero {z} --ac none --grad-accum 1" in out for z in (1, 2, 3))


def test_long_sequences_also_try_context_parallelism():
    assert S.candidate_specs(8, max_tp=8, seq=4096) == S.candidate_specs(8, max_tp=8)  # no cp for short ones
    names = [S.spec_name(s, sp) for s, sp in S.candidate_specs(8, max_tp=8, seq=32768)]
    assert len(names) == len(set(names)) and "cp=8" in names and "fsdp=2,cp=2,tp=2,sp" in names
    assert "cp=8" not in [S.spec_name(s, sp) for s, sp in S.candidate_specs(8, max_tp=8, seq=6144)]  # 768 a rank
    # on fsdp=2,cp=2 the cp axis carries the ring, counted once per exchange (its sends): per layer, forward
    # cp-1 hops of the rank's K and V block, backward twice that; and the all-reduce over cp of the
    # fsdp-sharded fp32 gradients (parameters are replicated over cp), 2 (cp-1)/cp of them; and the loss's
    # all-reduce of its sum and token count (two fp32), once over the flattened fsdp x cp group
    model = tiny()
    cfg, b, s, cp = model.cfg, 8 // 2, 32 // 2, 2
    ring = 3 * cfg.n_layers * (cp - 1) * 2 * b * s * cfg.n_kv_heads * cfg.head_dim * 4
    grads = 2 * (4 * cfg.num_params() // 2) * (cp - 1) // cp
    (row,) = S.search(model, 4, device="h100", batch_shape=(8, 32), dtype="fp32", specs=["fsdp=2,cp=2"], zero=3)
    assert row.bytes_by_axis["cp"] == ring + grads
    assert row.bytes_by_axis["fsdp+cp"] == 2 * (2 * 4) * (4 - 1) // 4


def _children(pid: int) -> set[int]:
    """Every live descendant of process `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_search_and_its_workers(name):
    """The CLI stopped with SIGTERM (a job scheduler) or SIGINT (^C in its terminal) while its worker
    processes plan exits with a failure status, and none of its processes outlives it by a minute. Mutation:
    the signal ignored (`signal.signal(signal.SIGINT, signal.SIG_IGN)` in search_main), the search plans to
    its end and exits 0."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "spmd.search", "--model", "8b", "--world", "64", "--workers", "2"]
    # as from a terminal: ^C's default action, whatever this test's own launcher ignores
    as_in_a_terminal = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=as_in_a_terminal
    )
    try:
        workers: set = set()
        for _ in range(1200):  # until both workers run (the search plans for a minute or more after that)
            workers = {p for p in _children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()}
            if len(workers) >= 2 or proc.poll() is not None:
                break
            time.sleep(0.25)
        assert len(workers) >= 2, "the search never started its workers"
        everyone = _children(proc.pid)
        proc.send_signal(getattr(signal, name))
        assert proc.wait(timeout=120) != 0
        for _ in range(600):
            if not any(_alive(p) for p in everyone):
                break
            time.sleep(0.1)
        assert not [p for p in everyone if _alive(p)], "worker processes outlived the search"
    finally:
        for p in _children(proc.pid) | {proc.pid}:
            if _alive(p):
                os.kill(p, 9)


def test_the_command_plans_in_its_worker_processes():
    """`python -m spmd.search` with worker processes answers: each spawned worker runs the command module again
    as `__mp_main__`, which must do nothing (spmd.cli.run_command). Mutation: run_command raising there as on
    any import: every worker dies at start, the pool respawns it, and the search never answers (timeout)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "spmd.search", "--model", "tiny", "--world", "2", "--workers", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    for row in ("--mesh fsdp=2 --zero 3", "--mesh tp=2 ", "--mesh tp=2,sp "):
        assert row in out.stdout, out.stdout


class _DiesWhenUnpickled:
    """A model argument whose unpickling in a worker process ends that process at once."""

    def __reduce__(self):
        return (os._exit, (3,))


def test_a_worker_that_dies_stops_the_search_with_an_error():
    """Worker processes that die as they start (their model argument ends them) raise an error naming the fix
    within seconds, where the pool would respawn them and the search wait for ever. Mutation: Workers.map
    without its check of the pool's workers: the alarm after 60 s fails it."""
    import signal

    from spmd.analysis.search_pool import Workers

    def hung(signum, frame):
        raise AssertionError("the search waited for ever on its dead workers")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with Workers(_DiesWhenUnpickled(), 2) as workers:
            with pytest.raises(RuntimeError, match="worker process of the search ended unexpectedly.*--workers 1"):
                list(workers.map([[((("dp", 2),), "the rest of a job")]]))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_another_pool_of_the_program_is_not_taken_for_a_dead_worker():
    """The search watches its own worker processes: a program that runs it beside a process pool of its own
    (a data loader's, say) is not told that a search worker died. Mutation: counting every pool worker among
    this process's children (as `multiprocessing.active_children()` lists them) fails it."""
    import multiprocessing

    from spmd.analysis.search_pool import Workers

    other = multiprocessing.get_context("spawn").Pool(1)
    try:
        with Workers(models.preset("tiny"), 2) as workers:
            workers._check_alive()
            assert len(workers.pids) == 2
    finally:
        other.terminate()
        other.join()


def test_a_free_worker_plans_its_own_meshes_then_new_ones_then_anothers():
    """A worker keeps DTensor's prices of the meshes it planned, so a round gives each worker its own meshes
    first, then new ones, and only then takes another worker's (the last of the longest queue), never
    leaving a worker idle while any group waits. Mutation: new meshes before a worker's own fails it."""
    from spmd.analysis.search_pool import _next_group

    own, theirs, last, new = ["own"], ["theirs"], ["last of theirs"], ["new"]
    queues, fresh = {0: [own], 1: [theirs, last], 2: []}, [new]
    assert _next_group(0, queues, fresh) is own
    assert _next_group(2, queues, fresh) is new
    assert _next_group(0, queues, fresh) is last and queues[1] == [theirs]
    assert _next_group(1, queues, fresh) is theirs
    assert _next_group(2, queues, fresh) is None


def test_pipeline_specs_are_planned_whole_with_their_bubble():
    """A pp spec's row is explain's plan of the pipeline (memory and bytes of its busiest pp rank, equal), and
    its step is the rank's work over 1 - bubble, (p-1)/(m+p-1) for 1F1B. Mutation: dropping the bubble term
    (step = work) fails the step equation; planning pp specs by block extrapolation fails the memory."""
    from spmd.analysis.search_pipeline import Pipeline

    model = tiny(n_layers=4)
    ask = dict(device="h100", batch_shape=(8, 32), dtype="fp32", zero=3, ac="none")
    (row,) = S.search(model, 4, specs=["pp=2,fsdp=2"], pipeline=Pipeline("1f1b", 4), **ask)
    plan = spmd.explain(model, spmd.Rules.default(), {"pp": 2, "fsdp": 2}, batch_shape=(8, 32), microbatches=4)
    assert row.memory == plan.memory
    assert row.comm_bytes == sum(c.bytes for c in plan.collectives if c.kind != "recv")
    bubble = (2 - 1) / (4 + 2 - 1)
    work = row.compute_s + row.activation_comm_s + row.param_comm_s - row.hidden_s
    assert row.step_s == pytest.approx(work / (1 - bubble))
    assert row.bubble_s == pytest.approx(work * bubble / (1 - bubble))
    assert row.flags == "--mesh pp=2,fsdp=2 --zero 3 --ac none --grad-accum 1 --pp-schedule 1f1b --microbatches 4"
    from spmd.analysis.search import search_meshes

    names = [S.spec_name(sizes, sp) for sizes, sp in search_meshes(model, 4, None, 8, max_pp=2)]
    assert {"pp=2,fsdp=2", "pp=2,tp=2", "pp=2,tp=2,sp", "pp=2,dp=2", "fsdp=4"} <= set(names)
    assert len(names) == len(set(names)) and not any("pp=4" in n for n in names)
    assert "pp=4" in [S.spec_name(s, sp) for s, sp in search_meshes(model, 4, None, 8, max_pp=4)]
