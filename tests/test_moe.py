"""The mixture-of-experts model (models/moe.py) under expert parallelism matches one process.

Four gloo processes on CPU, fixed seeds, fused AdamW, 2 steps (the second's gradients, taken at the updated parameters,
and its update, reading Adam's stored moments, prove what a third did), each spec against the same model trained in
one process: loss (cross-entropy plus the router losses), every gradient and every updated parameter within 1e-5
(relative norm, as tests/test_spmd_numerics.py measures). In float64, as tests/test_pipeline.py and for its reason:
AdamW's first steps divide each gradient element by its own magnitude, so fp32 rounding (a different summation
order over ranks and micro-batches) grows to ~1e-5 in the parameters (measured in fp32: 1.1e-5 on ep=2,tp=2,
1.05e-5 on pp=2,ep=2), while a structural error is off by 1e-3 or more.
`pp=2,ep=2` runs through spmd.build_pipeline and Pipeline.step, clip_grad_norm_ and AdamW as launch.train
does; its one-process reference computes the same micro-batches (router losses are per micro-batch, as
under --grad-accum). The router is made uneven on purpose: in
every layer router rows 1 and 3 are the negatives of rows 0 and 2 and row 7 is zero, so at least two
logits are >= expert 7's and expert 7 gets no token in the first step; the other experts get unequal
counts. The distributed run's tokens per expert equal the one-process run's in every step.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import models
import spmd
from spmd import checkpoint
from spmd.analysis.record import CollectiveRecorder
from tests.dist_utils import run_distributed
from tests.measured import saved_bytes
from tests.spmd_cases import BATCH, SEQ, global_batch, norm_rel_err

TOL = 1e-5
ACT_TOL = 0.02
SPECS = ["ep=4", "fsdp=2,ep=2", "ep=2,tp=2"]
DTYPE = torch.float64
MICROBATCHES = 2  # of the pp=2,ep=2 pipeline
PLANNED = "fsdp=2,ep=2"
BALANCED = " (balanced routing assumed)"
DISPATCH, COMBINE = "dispatch tokens to their experts' ranks", "combine expert outputs on their tokens' ranks"


def moe_tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = models.preset("moe-tiny", kernels="torch").build().to(DTYPE)
    with torch.no_grad():
        for layer in model.layers:
            w = layer.feed_forward.router.weight
            w[1], w[3], w[7] = -w[0], -w[2], 0.0
    return model


def _data_slice(t, mesh, rules):
    n, r = rules.data_parallel_size(mesh), rules.data_parallel_rank(mesh)
    b = t.shape[0] // n
    return t[r * b : (r + 1) * b]


def _micro_batches(n_dp: int, microbatches: int) -> list[torch.Tensor]:
    """Rows of the global batch in each pipeline micro-batch: every data-parallel rank cuts its slice into
    `microbatches` consecutive pieces, and micro-batch m is piece m of every rank."""
    piece = BATCH // n_dp // microbatches
    return [
        torch.cat(
            [torch.arange(r * BATCH // n_dp + m * piece, r * BATCH // n_dp + (m + 1) * piece) for r in range(n_dp)]
        )
        for m in range(microbatches)
    ]


def _reference(steps: int = 2, micro: list | None = None, max_norm: float | None = None) -> list[dict]:
    """One process's trajectory: per step the loss, tokens per expert (of the last micro-batch), gradients,
    their norm before clipping to `max_norm` (if given), and updated parameters."""
    ref = moe_tiny()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    out = []
    for step in range(steps):
        tokens, targets = global_batch(step)
        loss = 0.0
        for rows in micro or [torch.arange(BATCH)]:
            part = ref(tokens[rows], targets[rows]) / len(micro or [rows])
            part.backward()
            loss += part.item()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item() if max_norm else None
        opt.step()
        opt.zero_grad()
        out.append(
            dict(
                loss=loss,
                counts=ref.router_stats()["tokens_per_expert"],
                grads=grads,
                norm=norm,
                params={n: p.detach().clone() for n, p in ref.named_parameters()},
            )
        )
    return out


def _token_exchanges(records) -> dict:
    """{(module, phase, why): bytes} of the all-to-alls that move tokens (not the counts' exchange)."""
    return {
        (r.module, r.phase, r.reason.replace(BALANCED, "")): r.bytes
        for r in records
        if r.kind == "all_to_all" and "tokens per expert" not in r.reason
    }


def _exchanges_of_routing(model, mesh) -> dict:
    """{(module, phase, why): bytes} that this rank must send, from the routing of the last forward: the rows
    bound for experts on other ranks (dispatch, and the backward of combine) and the rows other ranks sent
    here (combine, and the backward of dispatch)."""
    group, ep = mesh.get_group("ep"), mesh.size(mesh.mesh_dim_names.index("ep"))
    me, row = dist.get_rank(group), models.preset("moe-tiny").dim * DTYPE.itemsize
    out = {}
    for i, layer in enumerate(model.layers):
        mine = layer.feed_forward.tokens_per_expert.to_local().view(ep, -1)  # this rank's tokens per expert
        every = [torch.empty_like(mine) for _ in range(ep)]
        dist.all_gather(every, mine, group=group)
        sent = (mine.sum() - mine[me].sum()).item() * row
        returned = sum(every[s][me].sum().item() for s in range(ep) if s != me) * row
        name = f"layers.{i}.feed_forward.routed.experts"
        out[(name, "forward", DISPATCH)] = out[(name, "backward", f"backward of {COMBINE}")] = sent
        out[(name, "forward", COMBINE)] = out[(name, "backward", f"backward of {DISPATCH}")] = returned
    return out


def _check_against_plan(model, mesh, rules, records, kept: int, planned: dict):
    measured = _token_exchanges(records)
    assert measured == _exchanges_of_routing(model, mesh), measured
    assert len(set(measured.values())) > 1, measured  # uneven routing: the exchanges differ
    # explain plans the same exchanges, at the balanced-routing figure: k*b*s*h*(ep-1)/ep bytes each
    assert planned["exchanges"].keys() == measured.keys()
    cfg, ep = models.preset("moe-tiny"), 2
    tokens_here = BATCH * SEQ // rules.data_parallel_size(mesh)
    assert set(planned["exchanges"].values()) == {cfg.top_k * tokens_here * cfg.dim * DTYPE.itemsize * (ep - 1) // ep}
    # what autograd keeps grows with the rows a rank's experts received; summed over the ranks, the rows are
    # the balanced plan's. Gathered expert weights are not kept (ZeRO-3 regathers them for backward).
    total = torch.tensor(kept)
    dist.all_reduce(total)
    want = planned["activations"] * dist.get_world_size()
    assert abs(total.item() - want) <= ACT_TOL * want, (total.item(), want)


def _train_and_compare(spec, reference, planned=None):
    mesh = spmd.make_mesh(spmd.parse_spec(spec)[0])
    rules = spmd.Rules.default()
    model = spmd.parallelize(moe_tiny(), mesh, rules)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for step, ref in enumerate(reference):
        tokens, targets = global_batch(step)
        checked = planned and step == 0
        recorder = CollectiveRecorder(mesh) if checked else contextlib.nullcontext()
        with recorder:
            with saved_bytes(model) if checked else contextlib.nullcontext() as saved:
                loss = model(_data_slice(tokens, mesh, rules), _data_slice(targets, mesh, rules))
            loss.backward()
        if checked:
            _check_against_plan(model, mesh, rules, recorder.records, saved["activations"], planned)
        assert abs(loss.item() - ref["loss"]) <= TOL * abs(ref["loss"]), (spec, step, loss, ref["loss"])
        counts = model.router_stats()["tokens_per_expert"].full_tensor()
        assert torch.equal(counts, ref["counts"]), (spec, step, counts, ref["counts"])
        if step == 0:
            assert (counts == 0).any() and counts.max() > 2 * counts[counts > 0].min(), counts
        for name, p in model.named_parameters():
            err = norm_rel_err(p.grad.full_tensor(), ref["grads"][name])
            assert err <= TOL, f"{spec} step {step}: gradient of {name} off by {err:.2e}"
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref["params"][name])
            assert err <= TOL, f"{spec} step {step}: parameter {name} off by {err:.2e}"
    return model


def _pipeline_matches_one_process(reference, loss_scale=4.0, max_norm=0.5):
    """pp=2,ep=2 (1f1b) as launch.train steps it: Pipeline.step with a loss scale (fp16's, here 4), the
    gradients divided by it, clip_grad_norm_ over both stages, AdamW. Each stage adds its own layer's router
    losses: the first into backward through its output, the last to its loss; the step's loss has both."""
    mesh, rules, model = spmd.make_mesh({"pp": 2, "ep": 2}), spmd.Rules.default(), moe_tiny()
    layers = list(model.layers)
    pipe = spmd.build_pipeline(model, mesh, rules, schedule="1f1b", microbatches=MICROBATCHES, reduce_dtype=None)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    mine = [i for s in pipe.split.stages_of_rank(pipe.pp_rank) for i in s.blocks]
    for step, ref in enumerate(reference):
        tokens, targets = global_batch(step)
        loss = pipe.step(
            _data_slice(tokens, pipe.stage_mesh, rules),
            _data_slice(targets, pipe.stage_mesh, rules),
            loss_scale=loss_scale,
        )
        assert abs(loss.item() - ref["loss"]) <= TOL * abs(ref["loss"]), ("pp=2,ep=2", step, loss, ref["loss"])
        for i in mine:  # the last micro-batch's routing, uneven: expert 7 gets no token in the first step
            counts = layers[i].feed_forward.tokens_per_expert.full_tensor()
            assert torch.equal(counts, ref["counts"][i]), ("pp=2,ep=2", step, i, counts, ref["counts"][i])
            assert step or counts[7] == 0, counts
        for name, p in pipe.named_parameters():
            p.grad.div_(loss_scale)
            err = norm_rel_err(p.grad.full_tensor(), ref["grads"][name])
            assert err <= TOL, f"pp=2,ep=2 step {step}: gradient of {name} off by {err:.2e}"
        norm = pipe.clip_grad_norm_(max_norm)
        assert abs(norm.item() - ref["norm"]) <= TOL * ref["norm"] and ref["norm"] > max_norm, (norm, ref["norm"])
        opt.step()
        opt.zero_grad()
        for name, p in pipe.named_parameters():
            err = norm_rel_err(p.full_tensor(), ref["params"][name])
            assert err <= TOL, f"pp=2,ep=2 step {step}: parameter {name} off by {err:.2e}"


def _checkpoint_reshards_to_ep4(ckpt_dir, params):
    """The PLANNED model after its steps, saved, loads at ep=4 (2 whole experts per rank instead of 4 halves)
    and gives the logits of one process holding the reference's parameters."""
    mesh, rules = spmd.make_mesh({"ep": 4}), spmd.Rules.default()
    model = spmd.parallelize(moe_tiny(seed=1), mesh, rules)
    checkpoint.load(ckpt_dir, checkpoint.model_state(model))
    ref = moe_tiny(seed=1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name])
        tokens = global_batch(5)[0]
        logits = model(_data_slice(tokens, mesh, rules)).full_tensor()
        err = norm_rel_err(logits, ref(tokens))
    assert err <= TOL, f"logits after fsdp=2,ep=2 -> ep=4 off by {err:.2e}"


def _all_specs(rank, world, reference, planned, pipelined, ckpt_dir):
    for spec in SPECS:
        model = _train_and_compare(spec, reference, planned if spec == PLANNED else None)
        if spec == PLANNED:
            checkpoint.save(ckpt_dir, len(reference), checkpoint.model_state(model))
    _checkpoint_reshards_to_ep4(ckpt_dir, reference[-1]["params"])
    _pipeline_matches_one_process(pipelined)


@pytest.mark.slow
def test_expert_parallel_matches_one_process_and_explain(tmp_path):
    """Also, on PLANNED: the all-to-alls of a real step move exactly the bytes the routing that occurred
    implies (uneven: they differ from rank to rank), and explain lists the same exchanges at the
    balanced-routing figure, labelled so; the bytes autograd keeps for backward, summed over the ranks, are
    within ACT_TOL of explain's balanced figure times the world size (measured: 0.15% over). Its checkpoint
    loads at ep=4 with the one-process logits (checkpoints reshard between ep sizes)."""
    plan = spmd.explain(moe_tiny(), spmd.Rules.default(), spmd.parse_spec(PLANNED)[0], batch_shape=(BATCH, SEQ))
    assert all(BALANCED in c.reason for c in plan.collectives if c.kind == "all_to_all")
    # fsdp's gathered expert weights are not kept for backward (ZeRO-3 regathers them): the step keeps what
    # it keeps on ep=4, where each rank holds its experts whole and nothing is gathered, plus the root unit's
    # final norm and output weights, which stay gathered from forward to backward as FSDP2's root does (the
    # input embedding's backward reads token ids alone)
    unsharded = spmd.explain(moe_tiny(), spmd.Rules.default(), {"ep": 4}, batch_shape=(BATCH, SEQ))
    kept = sum(
        p.numel() * p.element_size()
        for n, p in moe_tiny().named_parameters()
        if not n.startswith(("layers.", "tok_embeddings."))
    )
    assert plan.memory["activations"] == unsharded.memory["activations"] + kept
    planned = {"exchanges": _token_exchanges(plan.collectives), "activations": plan.memory["activations"]}
    pipelined = _reference(micro=_micro_batches(2, MICROBATCHES), max_norm=0.5)  # pp=2,ep=2: ep splits the data
    run_distributed(_all_specs, 4, _reference(), planned, pipelined, str(tmp_path / "ckpt"), timeout_s=400)


@pytest.mark.parametrize(
    "rules, sizes, match",
    [
        (spmd.Rules({"batch": ("dp", "fsdp", "ep"), "experts": "tp"}), {"tp": 2}, "experts may be split over the ep"),
        (spmd.Rules({"batch": ("dp", "fsdp"), "experts": "ep"}), {"ep": 2}, "add 'ep' to the batch rule"),
        (spmd.Rules.default(), {"ep": 3}, "8 experts do not divide by ep=3"),
    ],
)
def test_unsupported_expert_layouts_are_named(rules, sizes, match):
    """Checked with the parameters' layouts, before parallelize's first collective (here on a fake world)."""
    with pytest.raises(ValueError, match=match):
        spmd.explain(moe_tiny(), rules, sizes, batch_shape=(12, SEQ))


def test_compiling_expert_blocks_is_an_error_naming_why():
    """The dispatch's split sizes are data (the routing): compile_blocks and launch.train --compile refuse it,
    on every rank before any collective (the config check), instead of recompiling for every routing."""
    from launch.config import load_config

    with pytest.raises(ValueError, match="layers.0.feed_forward.routed.experts.*depend on the routing"):
        spmd.compile_blocks(moe_tiny())
    with pytest.raises(ValueError, match="--compile with a mixture of experts is not supported"):
        load_config(["--model", "moe-tiny", "--mesh", "ep=4", "--compile"]).validate(4)
    load_config(["--model", "moe-tiny", "--mesh", "pp=2,ep=2"]).validate(4)  # pp with experts is a valid config
