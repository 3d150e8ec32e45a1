"""Offload cases of tests/test_zero.py's 4-process launch: what offloaded state a rank holds, where, and
that `offload="nvme:DIR"` trains a state many times larger than what the step keeps resident.

What "resident" means here, measured: the pages of the masters and AdamW moments (each a mapping of its
file under DIR, the only place they live) that are present in this process's page table, i.e. in its
resident set (/proc/self/pagemap). It is sampled at every collective of the step: each parameter's
all-gather runs right after its update, before its pages are released, when that parameter's state is in
memory.
"""

import os

import numpy as np
import torch

import spmd
from spmd.analysis.record import CollectiveRecorder
from tests.spmd_cases import global_batch, local_slice, norm_rel_err, tiny_model

__all__ = [
    "WIDE",
    "wide_model",
    "wide_reference",
    "nvme_memory",
    "nvme_streams_its_state",
    "params_on_host",
    "GatherInputs",
]

# many weights of similar size, so that one parameter's state is a small part of the whole (3.4M parameters)
WIDE = dict(dim=256, n_layers=4, ffn_dim=768)
WIDE_STEPS = 2


def wide_model():
    return tiny_model(**WIDE)


def wide_reference() -> tuple[list, dict]:
    """One process's losses over WIDE_STEPS AdamW steps of the wide model, and its parameters after them."""
    ref = wide_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(WIDE_STEPS):
        loss = ref(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _local_nbytes(t) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def nvme_memory(opt, directory: str) -> dict:
    """Under nvme:DIR: the bytes of this rank's state files (`optimizer_nvme`), and what the streamed step
    holds in host memory at once: the largest parameter's master and moments, and its gradient copy."""
    rank_dir = os.path.join(directory, f"rank{torch.distributed.get_rank():05d}")
    masters = [m for group in opt.param_groups for m in group["params"]]
    states = [
        _local_nbytes(m) + sum(_local_nbytes(opt.state[m][k]) for k in ("exp_avg", "exp_avg_sq")) for m in masters
    ]
    files = sum(os.path.getsize(os.path.join(rank_dir, f)) for f in os.listdir(rank_dir))
    assert files == sum(states), (files, sum(states))
    return {
        "optimizer_nvme": files,
        "optimizer_host": max(states),
        "gradients_host": max(_local_nbytes(m) for m in masters),
    }


def resident_bytes(tensors) -> int:
    """Bytes of the pages of `tensors`' storages that are present in this process's page table
    (/proc/self/pagemap bit 63): what of them is in its resident set."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        for t in tensors:
            storage = (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage()
            first, last = storage.data_ptr() // page, (storage.data_ptr() + storage.nbytes() - 1) // page
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
            total += int((entries >> np.uint64(63)).sum()) * page
    return total


class _ResidentAtCollectives(CollectiveRecorder):
    def __init__(self, mesh, state):
        super().__init__(mesh)
        self.state, self.samples = state, []

    def _add(self, *args):
        self.samples.append(resident_bytes(self.state))
        super()._add(*args)


def nvme_streams_its_state(reference, directory: str) -> None:
    """Stage 2 on fsdp=4 with the wide model under nvme:DIR: every loss and the parameters after the last
    step equal one process within 1e-5, and at every collective of each step no more than the largest parameter's state
    (plus page rounding) is resident, nothing before or after the step, while the whole state is more than 10 times
    that."""
    losses, ref_params = reference
    mesh = spmd.make_mesh({"fsdp": 4})
    model = spmd.parallelize(wide_model(), mesh, spmd.Rules.default(zero=2), offload=f"nvme:{directory}")
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    memory = nvme_memory(opt, directory)
    state = [
        t
        for group in opt.param_groups
        for m in group["params"]
        for t in (m, opt.state[m]["exp_avg"], opt.state[m]["exp_avg_sq"])
    ]
    limit = memory["optimizer_host"] + 3 * 4096  # a master and two moments, each rounded up to a page
    assert memory["optimizer_nvme"] > 10 * limit, memory
    for step, ref_loss in enumerate(losses):
        tokens, targets = global_batch(step)
        loss = model(local_slice(tokens, mesh), local_slice(targets, mesh))
        loss.backward()
        assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss.item(), ref_loss)
        before = resident_bytes(state)
        with _ResidentAtCollectives(mesh, state) as sampler:
            opt.step()
        after = resident_bytes(state)
        opt.zero_grad()
        assert len(sampler.samples) == len(list(model.parameters())), len(sampler.samples)
        peak = max(sampler.samples)
        if torch.distributed.get_rank() == 0:
            print(
                f"nvme step {step}: state {memory['optimizer_nvme'] / 2**20:.2f} MiB in files, resident at "
                f"most {peak / 2**20:.3f} MiB (bound {limit / 2**20:.3f}), before {before}, after {after}"
            )
        assert before == 0 and after == 0 and peak <= limit, (step, before, peak, after, limit)
    for name, p in model.named_parameters():
        err = norm_rel_err(p.full_tensor(), ref_params[name])
        assert err <= 1e-5, f"nvme wide: parameter {name} off by {err:.2e}"
    _checkpoint_leaves_nothing_resident(model, opt, state, directory)


def _checkpoint_leaves_nothing_resident(model, opt, state, directory: str) -> None:
    """A save reads the file-backed state and a load writes it in place: after either, none of it stays
    resident, and the loaded values are the saved ones."""
    from spmd import checkpoint

    ckpt = f"{directory}/ckpt"

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    saved = {name: whole(t).clone() for name, t in checkpoint.optim_state(model, opt).items()}
    checkpoint.save(ckpt, 1, checkpoint.model_state(model), checkpoint.optim_state(model, opt))
    after_save = resident_bytes(state)
    with torch.no_grad():
        for t in state[1::3] + state[2::3]:  # the moments (state holds master, exp_avg, exp_avg_sq per parameter)
            t.zero_()
    checkpoint.load(ckpt, checkpoint.model_state(model), checkpoint.optim_state(model, opt))
    after_load = resident_bytes(state)
    assert after_save == 0 and after_load == 0, (after_save, after_load)
    for name, t in checkpoint.optim_state(model, opt).items():
        assert torch.equal(whole(t), saved[name]), name


class GatherInputs(CollectiveRecorder):
    """A collective recorder that also keeps the storages its all-gathers read (`inputs`)."""

    def __init__(self, mesh):
        super().__init__(mesh)
        self.inputs = set()

    def _add(self, kind, axes, nbytes, op, t):
        if kind == "all_gather":
            self.inputs.add(t.untyped_storage()._cdata)
        super()._add(kind, axes, nbytes, op, t)


def params_on_host(model, opt, device: dict) -> dict:
    """Under offload="params" (stage 3, fp32): each parameter's shard is its own master and lives on the host
    (pinned when there is a CUDA device), and so do its gradient and AdamW's moments. The device holds none
    of them between uses: `device`'s bytes become the host's."""
    masters = [m for group in opt.param_groups for m in group["params"]]
    assert {id(m) for m in masters} == {id(p) for p in model.parameters()}
    for p in model.parameters():
        state = opt.state[p]
        for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]):
            assert t.device.type == "cpu", (p._spmd_name, t.device)
        assert p._local_tensor.is_pinned() == torch.cuda.is_available(), p._spmd_name
    host = {
        "parameters_host": device["parameters"],
        "gradients_host": device["gradients"],
        "optimizer_host": device["optimizer"],
    }
    return {**host, "parameters": 0, "gradients": 0, "optimizer": 0}
