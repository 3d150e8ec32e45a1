"""An exception raised inside a parallelized model's forward leaves nothing of spmd behind: torch's
torch-function and dispatch mode stacks, its saved-tensor hooks and spmd's own phase are as before the call, and
the next step trains exactly as a model that never failed (same loss, same gradients, bit for bit).

Mutation: post-hooks registered without `always_call=True` (spmd/runtime/local/hook_sets.py), so that neither a
module's own post-hook nor the root's unwinding (spmd.runtime.hooks._unwind) runs when the forward raises: the
global-view mode stays on the torch-function stack and the check of the stacks fails."""

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import spmd
from spmd.runtime import state as spmd_state
from spmd.runtime.state import Phase
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, local_slice, tiny_model

SPECS = ["tp=2", "fsdp=2", "dp=2", "fsdp=2,ac"]


class _Boom(RuntimeError):
    pass


def _stacks():
    return (
        list(_get_current_function_mode_stack()),
        list(_get_current_dispatch_mode_stack()),
        torch._C._autograd._top_saved_tensors_default_hooks(True),
        spmd_state.active_state(),
    )


def _step(model, mesh):
    tokens, targets = global_batch(0)
    loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _fail_then_step(rank, world):
    for spec in SPECS:
        ac = spec.endswith(",ac")
        sizes, flags = spmd.parse_spec(spec.removesuffix(",ac"))
        mesh = spmd.make_mesh(sizes)
        rules = spmd.Rules.default(sequence_parallel="sp" in flags)
        clean = spmd.parallelize(tiny_model(), mesh, rules)
        failing = spmd.parallelize(tiny_model(), mesh, rules)
        if ac:
            spmd.apply_activation_checkpointing(clean, "full")
            spmd.apply_activation_checkpointing(failing, "full")
        layer = failing.layers[1].feed_forward
        plain_forward = layer.forward
        layer.forward = lambda *a, **k: (_ for _ in ()).throw(_Boom("midway"))  # the second block fails
        before = _stacks()
        tokens, targets = global_batch(0)
        try:
            failing(local_slice(tokens, mesh), local_slice(targets, mesh))
            raise AssertionError("the forward did not raise")
        except _Boom:
            pass
        assert _stacks() == before, (spec, before, _stacks())
        assert failing._spmd_state.phase is Phase.IDLE and not failing._spmd_state.global_view, spec
        layer.forward = plain_forward
        want_loss, want_grads = _step(clean, mesh)
        got_loss, got_grads = _step(failing, mesh)
        assert torch.equal(got_loss, want_loss), (spec, got_loss, want_loss)
        for name, want in want_grads.items():
            assert torch.equal(got_grads[name], want), (spec, name)
        assert _stacks() == before, spec
        assert failing._spmd_state.phase is Phase.BACKWARD, spec  # its forward ended; its step has not run


def test_a_forward_that_raises_leaves_nothing_behind_and_the_next_step_matches():
    run_distributed(_fail_then_step, 2, timeout_s=240)
