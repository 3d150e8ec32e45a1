"""benchmarks.tensor_memory's tracker counts live tensor bytes exactly: each storage once, views free, frees
uncounted, DTensors by their local tensors, and an AdamW model's state by the textbook formula."""

import torch
from torch.distributed.tensor import DTensor, Shard

from benchmarks.tensor_memory import LiveTensorBytes
from spmd.analysis.fake import fake_world


def test_live_bytes_count_each_storage_once_and_forget_freed_ones():
    with LiveTensorBytes() as live:
        a = torch.empty(1000)  # 4,000 bytes
        view = a.view(10, 100)  # the same storage
        b = a + 1  # 4,000 more
        assert (live.now, live.peak) == (8000, 8000)
        del b
        assert live.now == 4000
        c = torch.zeros(250, dtype=torch.float64)  # 2,000
        assert (live.now, live.peak) == (6000, 8000)
        del a, view, c
        assert live.now == 0 and live.peak == 8000


def test_adamw_state_is_params_and_two_moments():
    """After a step and zero_grad(set_to_none=True): parameters (4P bytes), exp_avg and exp_avg_sq (8P), and
    one fp32 step count per parameter tensor; gradients and activations are gone."""
    torch.manual_seed(0)
    with LiveTensorBytes() as live:
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        x = torch.randn(16, 32)
        n = sum(p.numel() for p in model.parameters())
        tensors = len(list(model.parameters()))
        model(x).square().mean().backward()
        assert live.now >= 8 * n  # parameters and their gradients
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x
        assert live.now == 12 * n + 4 * tensors
        assert live.peak >= 12 * n + 4 * n  # during the step, gradients were alive with the state


def test_dtensor_ops_count_their_local_tensors():
    with fake_world({"dp": 2}) as (mesh, _):
        with LiveTensorBytes() as live:
            x = DTensor.from_local(torch.ones(64, 8), mesh, [Shard(0)], run_check=False)  # a view: nothing new
            base = live.now
            y = x * 2  # this rank's 64 x 8 fp32 block: 2,048 bytes
            assert isinstance(y, DTensor) and live.now - base == 64 * 8 * 4
            del y
            assert live.now == base
