"""On a mesh of one rank nothing moves, and the whole model runs on local tensors, as plain PyTorch runs it
(spmd.runtime.local.whole_model): no DTensor op in forward, losses, gradients and parameters those of the
plain model, for spmd's Llama and for transformers' LlamaForCausalLM, whose base model called on its own
still lays itself out. With a block under activation checkpointing the model goes back to the per-block path,
which the comparison covers too."""

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from benchmarks.overhead import count_ops
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, norm_rel_err, tiny_model

TOL = 1e-6  # fp32, the same ops in the same order: only AdamW's fused and unfused arithmetic may round apart


def _train_like_plain(model, plain, loss_fn, steps=3):
    """3 AdamW steps of both models; asserts losses, gradients and parameters agree within TOL, and returns
    the DTensor ops spmd's model dispatched in each forward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    dtensor_ops = []
    for step in range(steps):
        tokens, targets = global_batch(step)
        box = {}

        def forward():
            box["loss"] = loss_fn(model, tokens, targets)

        dtensor_ops.append(count_ops(forward)["DTensor ops"])
        box["loss"].backward()  # (its only DTensor ops: AccumulateGrad's detach of each parameter's gradient)
        ref_loss = loss_fn(plain, tokens, targets)
        ref_loss.backward()
        assert type(box["loss"]) is torch.Tensor
        assert abs(box["loss"].item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (step, box["loss"], ref_loss)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert norm_rel_err(p.grad.full_tensor(), q.grad) <= TOL, (step, name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert norm_rel_err(p.full_tensor(), q.detach()) <= TOL, name
    return dtensor_ops


def _llama_loss(model, tokens, targets):
    return model(tokens, targets)


def _spmd_llama(rank, world):
    mesh = spmd.make_mesh({"dp": 1})
    model, plain = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default()), tiny_model()
    assert _train_like_plain(model, plain, _llama_loss) == [0, 0, 0]
    logits = model(global_batch(0)[0])
    assert isinstance(logits, DTensor) and norm_rel_err(logits.full_tensor(), plain(global_batch(0)[0])) <= TOL

    # a block under activation checkpointing recomputes after the model's call: the blocks go their own way
    model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default())
    spmd.apply_activation_checkpointing(model, "selective:2")
    ops = _train_like_plain(model, tiny_model(), _llama_loss)
    assert all(n > 0 for n in ops), ops
    outside = [
        m
        for m in model.modules()
        if m is not model and not any(m is x for b in model.layers for x in list(b.modules())[1:])
    ]
    assert all(len(m._forward_pre_hooks) == 1 for m in outside), "the model's own modules carry the pass's hooks"
    assert not any(m._forward_pre_hooks for m in list(model.layers[1].modules())[1:]), (
        "the block left unchecked still runs on local tensors, its insides bare"
    )


def test_a_one_rank_mesh_runs_the_model_as_plain_pytorch():
    run_distributed(_spmd_llama, 1, timeout_s=180)


def _hf_llama(rank, world):
    transformers = pytest.importorskip("transformers")
    from tests.test_any_model import build

    mesh = spmd.make_mesh({"fsdp": 1})
    model, loss_fn = build("llama")
    plain, _ = build("llama")
    spmd.parallelize(model, mesh, spmd.Rules.default())
    assert _train_like_plain(model, plain, lambda m, tokens, targets: loss_fn(m, tokens % 256)) == [0, 0, 0]
    ids = global_batch(0)[0] % 256
    out = model(input_ids=ids)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast) and isinstance(out.logits, DTensor)
    # a module called on its own, outside the model's call, still lays itself out (its hooks stayed)
    hidden, ref = model.model(input_ids=ids).last_hidden_state, plain.model(input_ids=ids).last_hidden_state
    assert norm_rel_err(hidden.full_tensor(), ref) <= TOL


def test_transformers_llama_on_one_rank_runs_as_plain_pytorch():
    pytest.importorskip("transformers")
    run_distributed(_hf_llama, 1, timeout_s=180)


def _mixed_precision_accumulated(per_block: bool):
    from spmd.runtime.local.whole_model import drop_local_model
    from spmd.runtime.state import STATE_ATTR

    model = spmd.parallelize(
        tiny_model(), spmd.make_mesh({"dp": 1}), spmd.Rules.default(), param_dtype=torch.bfloat16, master="optimizer"
    )
    state = getattr(model, STATE_ATTR)
    if per_block:
        drop_local_model(model, state)
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    losses = []
    for step in range(2):
        tokens, targets = global_batch(step)
        with spmd.no_sync(model):
            box = {}
            dtensor_ops = count_ops(lambda: box.update(first=model(tokens[:4], targets[:4])))["DTensor ops"]
            first = box["first"]
            (first / 2).backward()
        # the path taken: the whole model on local tensors dispatches no DTensor op, the per-block path does
        assert (id(model) in state.local_members) is not per_block, (per_block, step)
        assert (dtensor_ops > 0) is per_block, (per_block, step, dtensor_ops)
        second = model(tokens[4:], targets[4:])
        (second / 2).backward()
        losses += [first.item(), second.item()]
        opt.step()
        opt.zero_grad()
    return losses, [p.full_tensor() for p in model.parameters()]


def _same_as_per_block(rank, world):
    (whole, whole_params), (blocks, block_params) = (_mixed_precision_accumulated(b) for b in (False, True))
    assert whole == blocks
    assert all(torch.equal(a, b) for a, b in zip(whole_params, block_params))


def test_one_rank_in_bf16_with_accumulation_is_the_per_block_path_bit_for_bit():
    """bf16 compute, fp32 masters with the optimizer, two micro-batches under no_sync: the same casts and sums
    as the per-block path, which the multi-rank tests hold against one device. Each run asserts the path it
    took (kills `drop_local_model` made a no-op, which sent both runs down the whole-model path)."""
    run_distributed(_same_as_per_block, 1, timeout_s=180)
