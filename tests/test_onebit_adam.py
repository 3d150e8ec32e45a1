"""spmd.OneBitAdam on 4 gloo processes equals 1-bit Adam computed in one process with no communication
(tests/onebit_reference.py, written from the paper's equations), and its momentum crosses the wire in ~1/32 of
fp32's bytes after warm-up.

Tolerance 1e-5 relative (losses; parameters as ||a-b||/||b||) over 20 steps across the warm-up boundary (8
exact AdamW steps): the warm-up's reduced gradients sum in another order than the reference's mean (~1e-7);
from then on the workers' local gradients equal the reference's bit for bit, and the compression is exact
arithmetic on them. A sign that rounding flipped would show as ~1e-3, so the model is the tiny Llama cut to one
block of width 32 and a vocabulary of 128 (14k parameters: few elements near zero to flip; and fast).
"""

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd import checkpoint
from spmd.analysis.record import CollectiveRecorder
from spmd.optim.onebit_wire import exchange, pack_signs, padded_numel, unpack_signs
from tests.dist_utils import run_distributed
from tests.onebit_reference import ReferenceOneBitAdam
from tests.spmd_cases import BATCH, global_batch, local_slice, norm_rel_err, tiny_model

TOL = 1e-5
LR, BETAS, EPS, WD, WARMUP = 2e-3, (0.9, 0.999), 1e-8, 0.1, 8
STEPS, SAVE_AT, MEASURED = 20, 12, 12  # the step after SAVE_AT steps is recorded: compressed, not the first
WORKERS = 4


SMALL = dict(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128)


def _model():
    return tiny_model(**SMALL)


def _batch(step):
    return global_batch(step, vocab=SMALL["vocab_size"])


def _optimizer(model):
    return spmd.OneBitAdam(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, warmup=WARMUP)


def _reference_run(workers: int = WORKERS, steps: int = STEPS) -> list[tuple[float, dict]]:
    """(global loss, parameters after the step) of each step: each worker's gradient from its batch slice."""
    ref = _model()
    opt, out, b = ReferenceOneBitAdam(ref, workers, LR, BETAS, EPS, WD, WARMUP), [], BATCH // workers
    for step in range(steps):
        tokens, targets = _batch(step)
        grads, losses = [], []
        for i in range(workers):
            loss = ref(tokens[i * b : (i + 1) * b], targets[i * b : (i + 1) * b])
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            ref.zero_grad()
        opt.step(grads)
        out.append((sum(losses) / workers, {n: p.detach().clone() for n, p in ref.named_parameters()}))
    return out


def _laid_out(spec):
    mesh = spmd.make_mesh(spmd.parse_spec(spec)[0])
    model = spmd.parallelize(_model(), mesh, spmd.Rules.default())
    return model, _optimizer(model), mesh


def _one_step(model, opt, mesh, step):
    tokens, targets = _batch(step)
    loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train(label, model, opt, mesh, ref, steps):
    worst = 0.0
    for step in steps:
        loss = _one_step(model, opt, mesh, step)
        want_loss, want = ref[step]
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (label, step, loss, want_loss)
        for name, p in model.named_parameters():
            err = norm_rel_err(p.full_tensor(), want[name])
            assert err <= TOL, f"{label} step {step}: parameter {name} off by {err:.2e}"
            worst = max(worst, err)
    if dist.get_rank() == 0:
        print(f"{label}: steps {steps.start}-{steps.stop - 1}, largest parameter error {worst:.1e}")


def _check_wire_bytes(model, opt, mesh, step):
    """One compressed step: no gradient reduction in backward, and the optimizer's two collectives move
    2*(N-1)*(sum_p ceil(numel_p/8N)*8N/(8N) + 4*P) bytes per rank: signs 8 per byte, one fp32 scale per
    chunk per parameter."""
    recorder = CollectiveRecorder(mesh)
    with recorder:
        _one_step(model, opt, mesh, step)
    reductions = [c for c in recorder.records if c.kind in ("reduce_scatter", "all_reduce") and c.phase == "backward"]
    assert not reductions, f"backward still reduced gradients after warm-up: {reductions[:3]}"
    ours = [c for c in recorder.records if c.phase == "optimizer"]
    assert sorted(c.kind for c in ours) == ["all_gather", "all_to_all"], ours
    numels = [p.numel() for p in model.parameters()]
    n = WORKERS
    signs = 2 * (n - 1) * sum(-(-k // (8 * n)) for k in numels)  # each chunk ceil(numel/8N) bytes
    scales = 2 * (n - 1) * 4 * len(numels)
    measured = sum(c.bytes for c in ours)
    fp32_all_reduce = 2 * (n - 1) * 4 * sum(numels) // n
    if dist.get_rank() == 0:
        print(
            f"1-bit momentum: {measured:,} bytes/rank/step = signs {signs:,} + scales {scales:,}; fp32 all-reduce "
            f"{fp32_all_reduce:,}; ratio {measured / fp32_all_reduce:.5f}, signs alone {signs / fp32_all_reduce:.5f}"
        )
    assert measured == signs + scales, (measured, signs, scales)
    assert signs <= fp32_all_reduce / 32 * 1.01, (signs, fp32_all_reduce)  # padding to 8N: < 1% here


def _save(ckpt_dir, model, opt):
    checkpoint.save(ckpt_dir, SAVE_AT, checkpoint.model_state(model), checkpoint.optim_state(model, opt))


def _resume(label, spec, ckpt_dir, ref):
    """A fresh model and optimizer on `spec` load the checkpoint and continue as the uninterrupted run."""
    model, opt, mesh = _laid_out(spec)
    checkpoint.load(ckpt_dir, checkpoint.model_state(model), checkpoint.optim_state(model, opt, init=True))
    assert opt.steps_done() == SAVE_AT and opt.compressing()
    _train(label, model, opt, mesh, ref, range(SAVE_AT, STEPS))


def _four_ranks(rank, world, ckpt_dir, ref):
    model, opt, mesh = _laid_out("dp=2,fsdp=2")
    _train("dp=2,fsdp=2", model, opt, mesh, ref, range(STEPS))
    model, opt, mesh = _laid_out("fsdp=4")
    _train("fsdp=4", model, opt, mesh, ref, range(SAVE_AT))
    _save(ckpt_dir, model, opt)
    _check_wire_bytes(model, opt, mesh, MEASURED)
    _train("fsdp=4 after the measured step", model, opt, mesh, ref, range(MEASURED + 1, STEPS))
    _resume("fsdp=4 resumed on fsdp=4", "fsdp=4", ckpt_dir, ref)
    _resume("fsdp=4 resumed on dp=4", "dp=4", ckpt_dir, ref)


@pytest.mark.slow
def test_onebit_adam_matches_the_reference_on_four_ranks_and_resumes(tmp_path):
    """dp=2,fsdp=2 for 20 steps; fsdp=4 for 20 steps with a checkpoint after 12 and the 13th step's bytes
    measured; the checkpoint resumed on fsdp=4 and on dp=4; each against the reference with 4 workers.

    Mutations checked: the server error never updated (`s.copy_(...)` dropped in onebit_wire.exchange) fails
    dp=2,fsdp=2 at step index 9, the second compressed step (1.7e-1); the error buffers made plain tensors
    instead of one row per rank (`_per_rank` returning `row`: the checkpoint keeps rank 0's row only) fails
    the resume on fsdp=4 at its first step (6.3e-2); signs sent one per byte instead of 8 (`pack_signs` and
    `unpack_signs` without the bit packing: same numerics) fails the byte count (26,544 bytes, not 3,570)."""
    run_distributed(_four_ranks, 4, str(tmp_path / "ckpt"), _reference_run(), timeout_s=300)


def test_one_process_matches_the_reference_with_one_worker():
    """A plain model in one process is 1-bit Adam with N = 1 (the worker's and the server's compressions,
    no communication), over the warm-up and 4 compressed steps. Mutation checked: the frozen variance's bias
    correction taken at step t instead of at the warm-up's last step fails at the first compressed step."""
    ref = _reference_run(workers=1, steps=WARMUP + 4)
    model = _model()
    opt = _optimizer(model)
    for step in range(WARMUP + 4):
        tokens, targets = _batch(step)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - ref[step][0]) <= TOL * ref[step][0], step
        for name, p in model.named_parameters():
            assert norm_rel_err(p.detach(), ref[step][1][name]) <= TOL, (step, name)


def test_signs_pack_eight_to_a_byte_and_one_worker_exchange_compresses_twice():
    """pack/unpack round-trip the signs (+1 at zero) in n/8 bytes; with one worker the exchange returns
    C(x) = mean|x| sign(x) per chunk and keeps x - C(x) as the worker's error."""
    x = torch.tensor([0.5, -2.0, 0.0, 3.0, -0.1, 1.0, -1.0, 2.0] * 2)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    assert padded_numel(17, 4) == 32
    worker, server = torch.zeros(16), torch.zeros(16)
    (out,) = exchange([x.clone()], [worker], [server], world=1)
    want = x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)
    assert (
        torch.allclose(out, want)
        and torch.allclose(worker, x - want)
        and torch.allclose(server, torch.zeros(16), atol=1e-6)
    )
