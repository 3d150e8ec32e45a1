"""The step-time model's CPU figures: collectives timed inside a real step (spmd.analysis.timed), the per-kind
link fit (benchmarks.step_fit) and the per-kind link table of a Device (step_time.predict)."""

import math
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import spmd
from benchmarks.step_fit import device_for, fit_kinds
from spmd.analysis import summaries
from spmd.analysis.devices import DEVICES, Device, Link
from spmd.analysis.record import CollectiveRecorder, ring_steps
from spmd.analysis.step_time import predict
from spmd.analysis.timed import TimedRecorder, samples
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, local_slice, plan_for, tiny_model

# per kind: latency, latency per ring step, bandwidth (bytes/s)
TRUE = {"all_reduce": (2e-4, 5e-4, 3e9), "all_gather": (1e-4, 2e-4, 1e9), "reduce_scatter": (3e-4, 1e-4, 5e8)}


def test_fit_per_kind_recovers_each_kinds_latency_and_bandwidth():
    """Samples made from TRUE over groups of 2 and 4 ranks, three of each, one of the three 5x slow (a rank
    descheduled): each kind's fit gives its own figures back (1e-6), the pooled one none of them. With one
    group size the ring steps cannot be told from the latency: they are folded into it. Mutations that fail
    it (tried): fit_link counting n-1 ring steps for every kind (all-reduces' 2(n-1) lost); fitting every
    sample instead of the median of each (kind, ranks, bytes)."""
    rows = [
        {"kind": kind, "ranks": n, "wire_bytes": b, "seconds": slow * (lat + ring_steps(kind, n) * step + b / bw)}
        for kind, (lat, step, bw) in TRUE.items()
        for n in (2, 4)
        for b in (1e3, 1e5, 1e6, 1e7)
        for slow in (1, 5, 1)
    ]
    fits = fit_kinds(rows, 4)
    assert set(fits) == {*TRUE, "pooled"}
    for kind, (lat, step, bw) in TRUE.items():
        f = fits[kind]
        assert (f["samples"], f["groups"], f["rel_rms"]) == (24, 8, pytest.approx(0, abs=1e-9)), kind
        assert f["latency_s"] == pytest.approx(lat, rel=1e-6), kind
        assert f["step_latency_s"] == pytest.approx(step, rel=1e-6), kind
        assert f["bandwidth_Bps"] == pytest.approx(bw, rel=1e-6), kind
    assert fits["pooled"]["samples"] == len(rows) and fits["pooled"]["rel_rms"] > 0.05  # one link fits none well
    dev = device_for(4, 1e9, fits)
    assert dev.link("all_gather", inter=False) == Link(*(fits["all_gather"][k] for k in _FIGURES))
    assert dev.link("broadcast", inter=False) == Link(*(fits["pooled"][k] for k in _FIGURES))  # no samples
    lat, step, bw = TRUE["all_reduce"]
    four = fit_kinds([r for r in rows if r["ranks"] == 4 and r["kind"] == "all_reduce"], 4)["all_reduce"]
    assert (four["latency_s"], four["step_latency_s"]) == (pytest.approx(lat + 6 * step, rel=1e-6), 0.0)
    assert four["bandwidth_Bps"] == pytest.approx(bw, rel=1e-6)


_FIGURES = ("latency_s", "step_latency_s", "bandwidth_Bps")


def test_per_kind_links_price_each_kind_the_rest_on_the_single_link():
    """tiny at fsdp=2,tp=2,sp (explain's plan): with all-gathers at 10 ms per ring step and reduce-scatters at
    1 MB/s, every other collective at 1 ms on the single link, the step is the sum of those over the plan's
    collectives, counted here one by one. Mutation that fails it (tried): Device.link ignoring kind_links."""
    plan = plan_for("fsdp=2,tp=2,sp")
    sizes = {"fsdp": 2, "tp": 2}
    single = dict(intra_bw=1e30, inter_bw=1e30, intra_latency=1e-3, inter_latency=1e-3, overlaps_comm=False)
    dev = Device("cpu-like", {"fp32": 1e9}, 1e12, per_node=1 << 30, **single)
    table = {"all_gather": Link(0.0, 1e-2, 1e30), "reduce_scatter": Link(0.0, 0.0, 1e6)}
    fitted = dev.replace(kind_links=tuple(sorted(table.items())))

    def by_hand(c):
        n = math.prod(sizes.get(a, 1) for a in c.axes)
        return {"all_gather": 1e-2 * ring_steps("all_gather", n), "reduce_scatter": c.bytes / 1e6}.get(c.kind, 1e-3)

    kinds = Counter(c.kind for c in plan.collectives)
    assert kinds["all_gather"] and kinds["reduce_scatter"] and kinds["all_reduce"]
    s = summaries.summarize(plan)
    assert predict(s, sizes, fitted, 0.0)["step_s"] == pytest.approx(sum(map(by_hand, plan.collectives)), rel=1e-9)
    assert predict(s, sizes, dev, 0.0)["step_s"] == pytest.approx(1e-3 * len(plan.collectives), rel=1e-9)
    assert DEVICES["h100"].kind_links == ()  # the GPU entries keep their one link per level


LATE_S = 1.0  # rank 1 starts its timed step this late


def _grads(model) -> dict:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _timed_steps(rank, world):
    for spec in ("fsdp=2", "dp=2"):  # functional collectives (fsdp), in-place c10d all-reduces (dp)
        sizes, flags = spmd.parse_spec(spec)
        mesh = spmd.make_mesh(sizes)
        out = {}
        for recorder in (CollectiveRecorder(mesh), TimedRecorder(mesh)):
            model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default(sequence_parallel="sp" in flags))
            tokens, targets = global_batch(0)
            dist.barrier()  # the ranks leave it together (within the noise of a loaded machine: << LATE_S / 2)
            if rank == 1 and isinstance(recorder, TimedRecorder):
                time.sleep(LATE_S)
            with recorder:
                model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
            out[type(recorder)] = (recorder, _grads(model))
        (plain, grads), (timed, timed_grads) = out[CollectiveRecorder], out[TimedRecorder]
        a, b = Counter(map(_key, timed.records)), Counter(map(_key, plain.records))
        assert a == b, (spec, a - b, b - a)
        assert len(timed.seconds) == len(timed.records) and all(s >= 0 for s in timed.seconds)
        for name, g in grads.items():  # waiting where issued changes no value
            torch.testing.assert_close(timed_grads[name], g, rtol=0, atol=0, msg=f"{spec} {name}")
        if rank == 0:  # its first collective completes only once rank 1, started late, joins it
            assert timed.seconds[0] >= LATE_S / 2, (spec, timed.seconds[:3])
            rows = samples(timed, sizes)
            assert {r["kind"] for r in rows} >= ({"all_reduce"} if spec == "dp=2" else {"all_gather", "reduce_scatter"})
            assert all(r["ranks"] == 2 and r["steps"] == ring_steps(r["kind"], 2) for r in rows)
    timed, x = TimedRecorder(), torch.ones(4)
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    with timed:  # c10d's own async all-reduce, as spmd.runtime.collectives issues the dp gradients'
        dist.all_reduce(x, async_op=True).wait()
    assert x.tolist() == [2.0] * 4 and timed.records[0].kind == "all_reduce"
    assert rank == 1 or timed.seconds[0] >= LATE_S / 2, timed.seconds


def _key(c):
    return (c.module, c.kind, c.axes, c.bytes, c.phase, c.reason)


@pytest.mark.slow
def test_collectives_are_timed_from_issue_to_completion_inside_a_real_step():
    """fsdp=2 and dp=2 on 2 processes, one launch: the timed step issues the plain recorder's collectives and
    computes the same gradients (bit for bit); rank 0's first collective takes at least half the time rank 1
    starts late (the rest a margin for the ranks' own noise), and so does a c10d async all-reduce. Mutations
    that fail it (tried): TimedRecorder not waiting where it issues (`_wait` a no-op): the first collective's
    time is its issue only; `_wait` ignoring a c10d op's Work."""
    run_distributed(_timed_steps, 2)


def test_validation_takes_each_specs_median_over_rounds_and_checks_the_top_2():
    """compare(): three specs in the planner's order, three rounds each (one round of B 10x slow, a loaded
    machine): a spec's figure is the median of its rounds' medians; B measures best and is the planner's
    second, so within its top 2; Spearman of the planner 0.5 (ranks 1 2 3 against 2 1 3). Mutation that
    fails it (tried): the mean over rounds instead of the median (B's slow round makes it last)."""
    from types import SimpleNamespace

    from benchmarks.search_vs_measured import compare

    def row(spec, step_s, collectives):
        return SimpleNamespace(
            spec=spec,
            step_s=step_s,
            compute_s=0.0,
            activation_comm_s=0.0,
            param_comm_s=step_s,
            comm_bytes=collectives * 100,
            collectives=collectives,
        )

    rows = [row("A", 1.0, 2), row("B", 2.0, 3), row("C", 3.0, 1)]
    times = {"A": [[0.20, 0.21, 0.22]] * 3, "B": [[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.12, 0.1, 0.11]]}
    times["C"] = [[0.3, 0.3, 0.3]] * 3
    collective = {"kind": "all_reduce", "ranks": 2, "steps": 2, "wire_bytes": 8, "seconds": 0.01}
    jobs = [
        {"model": "m", "spec": s, "round": i, "step_times": t, "collectives": [collective]}
        for s, rounds in times.items()
        for i, t in enumerate(rounds)
    ]
    entry = compare("m", rows, jobs)
    got = {r["spec"]: r for r in entry["rows"]}
    assert got["B"]["measured_s"] == pytest.approx(0.11) and got["B"]["measured_rounds"] == [0.1, 1.0, 0.11]
    assert [got[s]["measured_rank"] for s in "ABC"] == [2, 1, 3]
    assert (entry["measured_best"], entry["measured_best_in_top_2"]) == ("B", True)
    assert entry["spearman_predicted"] == pytest.approx(0.5)
    assert entry["spearman_collectives"] == pytest.approx(-1.0)  # ranks 2 3 1 by collectives against 2 1 3
    assert got["A"]["timed_comm_s"] == pytest.approx(0.01)


def test_each_spec_is_fitted_without_its_own_collectives():
    """A spec's links come from every other spec's timed collectives, of every model, never its own (leave one
    spec out). Mutation: holding out by model (the other model's samples alone) keeps small's `dp=4` and drops
    tiny's `tp=4`: fails."""
    from benchmarks.step_fit import held_out

    samples = [
        {"model": m, "spec": s, "kind": "all_reduce", "ranks": 4, "wire_bytes": 8 * i, "seconds": 1e-3 * i}
        for i, (m, s) in enumerate([(m, s) for m in ("tiny", "small") for s in ("dp=4", "tp=4", "fsdp=4")], 1)
    ]
    kept = held_out("dp=4", samples)
    assert {(r["model"], r["spec"]) for r in kept} == {(m, s) for m in ("tiny", "small") for s in ("tp=4", "fsdp=4")}
    with pytest.raises(ValueError, match="at least two specs"):
        held_out("dp=4", [r for r in samples if r["spec"] == "dp=4"])
