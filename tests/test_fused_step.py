"""A fused AdamW step on DTensor parameters runs on their local shards (spmd.runtime.dtensor.fused_step), on 2 gloo
processes.

Parameters sharded over fsdp on either dim and replicated, 3 steps of torch's fused AdamW with weight decay
and amsgrad: the local update equals plain PyTorch on the whole tensors within 1e-6 (the same kernel on
each element; the reference sees whole tensors), and it is the path taken (no DTensor dispatch of the fused
op). A gradient in another layout than its parameter (replicated where the parameter is sharded) is left
to DTensor's own dispatch, which redistributes it, and the result still equals plain PyTorch.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import spmd
from spmd.runtime.dtensor import fused_step
from tests.dist_utils import run_distributed

TOL = 1e-6
SHAPES_AND_LAYOUTS = [((8, 6), Shard(0)), ((6, 8), Shard(1)), ((5,), Replicate())]


def _grads(step: int) -> list:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g) for shape, _ in SHAPES_AND_LAYOUTS]


def _reference(steps: int) -> list:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape, _ in SHAPES_AND_LAYOUTS]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True)
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


def _run(rank, world, reference, steps):
    mesh = spmd.make_mesh({"fsdp": 2})
    fused_step.install()
    torch.manual_seed(0)
    wholes = [torch.randn(shape) for shape, _ in SHAPES_AND_LAYOUTS]
    for grad_layout in ("same", "replicated"):
        params = [
            torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [layout]))
            for w, (_, layout) in zip(wholes, SHAPES_AND_LAYOUTS)
        ]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True)
        fallbacks = []
        dispatch = fused_step.dtensor_dispatch
        fused_step.dtensor_dispatch = lambda *a: (fallbacks.append(a[0]), dispatch(*a))[1]
        try:
            for step in range(steps):
                for p, g, (_, layout) in zip(params, _grads(step), SHAPES_AND_LAYOUTS):
                    p.grad = distribute_tensor(g, mesh, [layout if grad_layout == "same" else Replicate()])
                opt.step()
        finally:
            fused_step.dtensor_dispatch = dispatch
        assert bool(fallbacks) == (grad_layout == "replicated"), (grad_layout, fallbacks)
        for p, want in zip(params, reference):
            err = (p.full_tensor() - want).abs().max().item()
            assert err <= TOL, (grad_layout, p.shape, err)


@pytest.mark.slow
def test_fused_adamw_on_local_shards_equals_plain_pytorch():
    run_distributed(_run, 2, _reference(3), 3)
