"""Offload on a CUDA device: the states it moves leave device memory, and training is unchanged.

The CPU suite runs offload with host memory as the "device" (tests/test_zero.py); only a GPU shows that
`offload="optimizer"` and `offload="params"` free device memory and that the host step (pinned copies out
and back) trains as the device step does. One process, a one-process mesh, fp32, 3 AdamW steps against the
same model as plain PyTorch on the GPU. Skipped where there is no CUDA device (SPMD_OFFLOAD_DEVICE=cpu runs
the numerics on the CPU, without the memory checks).
"""

import os

import pytest
import torch

import spmd
from tests.spmd_cases import global_batch, norm_rel_err, tiny_model

DEVICE = torch.device(os.environ.get("SPMD_OFFLOAD_DEVICE", "cuda"))
# hardware CI lacks: only a GPU has device memory apart from the host's (offload on CPU: tests/test_zero.py)
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="measures the GPU memory offload frees: needs a CUDA device",
)

SHAPE = dict(dim=512, n_layers=4, ffn_dim=1536)  # 17M parameters: the states dwarf the allocator's slack
STEPS = 3
TOL = 1e-4  # relative norm of each updated parameter: fp32 reassociation (another reduction order in spmd's
# layouts, the host's AdamW against the device's), which Adam's 1/sqrt(v) magnifies in weights of small gradient


def _train(model, opt) -> list:
    losses = []
    for step in range(STEPS):
        x, y = (t.to(DEVICE) for t in global_batch(step))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _device_bytes() -> int:
    if DEVICE.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.fixture(scope="module")
def reference():
    """Plain PyTorch on the device: losses, updated parameters, device bytes held after the steps."""
    base = _device_bytes()
    model = tiny_model(**SHAPE).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = _train(model, opt)
    held = _device_bytes() - base
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    n_params = sum(p.numel() for p in params.values())
    del model, opt
    return losses, params, held, n_params


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_trains_as_the_device_step_and_frees_device_memory(reference, offload):
    ref_losses, ref_params, ref_held, n_params = reference
    mesh = spmd.make_mesh({"fsdp": 1}, device_type=DEVICE.type)
    base = _device_bytes()
    model = spmd.parallelize(tiny_model(**SHAPE).to(DEVICE), mesh, spmd.Rules.default(zero=3), offload=offload)
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    losses = _train(model, opt)
    held = _device_bytes() - base

    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in model.named_parameters():
        assert norm_rel_err(p.full_tensor().detach().cpu(), ref_params[n]) < TOL, n

    masters = [m for group in opt.param_groups for m in group["params"]]
    for m in masters:  # the masters AdamW updates live on the host, pinned with CUDA (they cross to the
        # device and back each step), and so do AdamW's moments (made by the step, never copied)
        assert m._local_tensor.is_pinned() == (DEVICE.type == "cuda"), m._spmd_name
        for t in (m, opt.state[m]["exp_avg"], opt.state[m]["exp_avg_sq"]):
            assert t._local_tensor.device.type == "cpu", (m._spmd_name, t._local_tensor.device)
    if DEVICE.type != "cuda":
        return
    print(
        f"offload={offload}: {held:,} device bytes held after the steps; plain PyTorch {ref_held:,}; "
        f"{n_params:,} parameters"
    )
    # plain PyTorch holds parameters, moments (3 x 4 bytes a parameter; gradients are freed by zero_grad);
    # offload="optimizer" keeps the parameters on the device and nothing of the optimizer, "params" nothing
    assert ref_held >= 12 * n_params
    kept = 4 * n_params if offload == "optimizer" else 0
    assert held <= kept + 0.05 * ref_held, (offload, held, kept, ref_held)


def test_gradient_copies_run_while_backward_computes(tmp_path):
    """offload="optimizer" copies each gradient to the host on a side stream as backward makes it: in the
    CUDA trace, a device-to-host copy starts before the last kernel of backward on the compute stream ends."""
    import json

    if DEVICE.type != "cuda":
        pytest.skip("the overlap of copies with kernels exists only on a CUDA device")
    mesh = spmd.make_mesh({"fsdp": 1}, device_type="cuda")
    model = spmd.parallelize(tiny_model(**SHAPE).to(DEVICE), mesh, spmd.Rules.default(zero=3), offload="optimizer")
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = (t.to(DEVICE) for t in global_batch(0))
    for _ in range(2):  # warm the allocator and the kernels up
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    compute = torch.cuda.current_stream().cuda_stream
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(x, y).backward()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("args", {}).get("stream") in (compute, 7)]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    assert kernels and copies, (len(kernels), len(copies))
    backward_ends = max(e["ts"] + e["dur"] for e in kernels)
    first_copy = min(e["ts"] for e in copies)
    print(
        f"first gradient copy starts {backward_ends - first_copy:.0f} us before backward's last kernel ends "
        f"({len(copies)} copies)"
    )
    assert first_copy < backward_ends
