"""`shard_optimizer(model, opt)`: the optimizer steps on the optimizer map's shards (ZeRO stages 1 and 2).

A parameter whose optimizer layout shards more than its storage, or whose fp32 master lives with the optimizer,
gets a master in the optimizer layout that the optimizer updates instead (a view of its local shard in fp32, else
a copy); gradients are sliced onto it before the step, the update all-gathered back after. Offloaded masters live
in host memory (transfer) or, under "nvme:DIR", in files streamed one parameter at a time (offload).
"""

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .. import tags
from ..dtensor.wrap import local_of, wrap_local
from ..gradients.layouts import HELD_ATTR, grads_layout, held_for_step, optim_layout, slice_onto_shards
from ..gradients.step_reduce import reduce_grads
from ..state import Phase, laid_out_parts
from .masters import MASTER_OF_ATTR, gather_into_param, gather_updated
from .offload import file_backed_adam_state, host_copy, nvme_dir, release_pages
from .transfer import GradientCopies

__all__ = ["shard_optimizer", "reduce_gradients", "masters_of", "refresh_masters"]


def shard_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes `opt` (on a parallelized model's or pipeline's parameters, not yet stepped) update masters in the
    optimizer map's layout, and returns it; `opt.zero_grad` clears the model's gradients too. Call it before the
    first backward: from then on ZeRO-1 gradients are left for the step to reduce."""
    parts = laid_out_parts(model, "shard_optimizer")
    if any(opt.state.values()):
        raise ValueError(
            "shard_optimizer needs an optimizer that has not stepped yet; call it right after "
            "building the optimizer (before loading a checkpoint into it)"
        )
    owner = {id(p): state for part, state in parts for p in part.parameters()}
    pairs = []
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            if id(p) not in owner:
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of this model; build it "
                    "from model.parameters() and pass the same model"
                )
            master = _master(p, owner[id(p)])
            if master is not p:
                pairs.append((p, master))
                setattr(p, HELD_ATTR, grads_layout(p) != tuple(master.placements))
                group["params"][i] = master
        # torch's fused AdamW takes each tensor as contiguous (CPU, 2.13): strided master views step with foreach
        if group.get("fused") and any(
            isinstance(m, DTensor) and not local_of(m).is_contiguous() for m in group["params"]
        ):
            group["fused"], group["foreach"] = False, True
    offload = parts[0][1].offload  # a pipeline's stages are laid out alike
    streamed = bool(pairs) and nvme_dir(offload) is not None
    if streamed and not is_fake(pairs[0][1]):
        file_backed_adam_state(opt, [m for _, m in pairs], nvme_dir(offload))
        release_pages(_file_tensors(opt, [m for _, m in pairs]))
    if pairs:
        copy_out = offload is not None  # a real copy even where host memory is the device
        copies = GradientCopies(pairs, pairs[0][0].device) if offload == "optimizer" else None
        if copies is not None:
            for _, state in parts:  # gradients the cross-block reducer reduces in flat buffers
                if state.reducer is not None:
                    state.reducer.copies = copies
        _install_step_hooks(opt, model, parts, pairs, streamed, copy_out, copies)
    return opt


def _install_step_hooks(opt, model, parts, pairs, streamed: bool, copy_out: bool, copies) -> None:
    """Step pre/post hooks (gradients to masters; updated masters gathered back) and a zero_grad for the model too."""

    def before_step(*_):  # returns None: a pre-hook's return value would replace the step's arguments
        for _, laid_out in parts:
            laid_out.phase = Phase.OPTIMIZER_STEP
        reduce_gradients(model)
        if streamed:  # the step proper then finds no gradient left and does nothing
            _stream_step(opt, pairs)
        else:
            _grads_to_masters(pairs, copy_out, copies)

    def after_step(*_):
        if not streamed:
            gather_updated(opt)
        for _, laid_out in parts:
            laid_out.phase = Phase.IDLE

    opt.register_step_pre_hook(before_step)
    opt.register_step_post_hook(after_step)
    clear = opt.zero_grad

    def zero_grad(set_to_none: bool = True):
        clear(set_to_none)
        for part, _ in parts:
            part.zero_grad(set_to_none)
        if copies is not None:  # the records go with the gradients, and the device memory they hold
            copies.copied.clear()

    opt.zero_grad = zero_grad


@torch.no_grad()
def reduce_gradients(model: nn.Module) -> None:
    """Reduces ZeRO-1's held gradients straight onto the optimizer shards (a reduce-scatter, Ψ, not an all-reduce's
    2Ψ), once per step however many backwards accumulated. Call it before clipping (the step calls it too)."""
    parts = laid_out_parts(model, "reduce_gradients")
    dtype = parts[0][1].reduce_dtype or parts[0][1].param_dtype  # a pipeline's stages are laid out alike
    held = [
        p
        for part, _ in parts
        for p in part.parameters()
        if p.grad is not None and held_for_step(p) and any(pl.is_partial() for pl in p.grad.placements)
    ]
    reduce_grads(
        held,
        [optim_layout(p) for p in held],
        dtype,
        "optimizer",
        "reduce gradient buckets into optimizer shards",
        parts[0][1].wire,
    )


def masters_of(opt: torch.optim.Optimizer) -> dict:
    """{id(master): model parameter} of an optimizer `shard_optimizer` prepared (empty otherwise)."""
    return {
        id(m): getattr(m, MASTER_OF_ATTR) for g in opt.param_groups for m in g["params"] if hasattr(m, MASTER_OF_ATTR)
    }


@torch.no_grad()
def refresh_masters(opt: torch.optim.Optimizer) -> None:
    """Copies the parameters into the masters that are copies (after loading parameters in place: a resume
    under master="optimizer" restarts the fp32 master from the stored parameters). Views need nothing."""
    for m in (m for g in opt.param_groups for m in g["params"] if hasattr(m, MASTER_OF_ATTR)):
        local = _local_view(getattr(m, MASTER_OF_ATTR), m.placements)
        if local.untyped_storage()._cdata != local_of(m).untyped_storage()._cdata:
            local_of(m).copy_(local)


def _master(p: DTensor, state) -> DTensor:
    optim = optim_layout(p)
    lower = state.master == "optimizer" and p.dtype != torch.float32 and p.dtype.is_floating_point
    if optim == tuple(p.placements) and not lower and state.offload in (None, "params"):  # params: on the host
        return p
    if not all(a == b or (a.is_replicate() and b.is_shard()) for a, b in zip(grads_layout(p), optim)):
        raise ValueError(
            f"{p._spmd_name}: the optimizer map must shard at least as much as the grads map "
            f"({grads_layout(p)} -> {optim})"
        )
    with torch.no_grad():
        local = _local_view(p, optim)
        local = local.float() if lower else local  # (a copy: p is not fp32)
        if state.offload is not None:
            local = host_copy(local, state.offload, p._spmd_name)
        master = nn.Parameter(
            wrap_local(local, p.device_mesh, optim, p.shape, p.stride()), requires_grad=p.requires_grad
        )
    setattr(master, MASTER_OF_ATTR, p)
    master._spmd_name = p._spmd_name
    return master


def _local_view(p: DTensor, optim) -> torch.Tensor:
    """The part of p's local tensor that the layout `optim` gives this rank (a view: it shares storage)."""
    mesh = p.device_mesh
    mine, mine_at = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
    want, want_at = compute_local_shape_and_global_offset(p.shape, mesh, optim)
    local = local_of(p)
    for d, (n, at, base, base_n) in enumerate(zip(want, want_at, mine_at, mine)):
        if at < base or at + n > base + base_n or not _nests(p, optim, d):  # (_nests: the same on every rank)
            raise ValueError(
                f"{p._spmd_name}: its optimizer shard {optim} is not inside its stored shard "
                f"{tuple(p.placements)} on every rank; the optimizer map may only add sharding to the params "
                f"map, and a tensor dim it splits further must be split first by the mesh axes that store it "
                f"(in mesh order): split another dim over the added axis (the default: embed over fsdp)"
            )
        local = local.narrow(d, at - base, n)
    return local


def _nests(p: DTensor, optim, d: int) -> bool:
    """Whether tensor dim `d`'s stored mesh axes come first, in mesh order, among the optimizer's: then every
    rank's optimizer chunk lies inside its stored chunk (DTensor splits by mesh dims in order)."""
    mesh = p.device_mesh
    stored = [m for m, x in enumerate(p.placements) if mesh.size(m) > 1 and x.is_shard(d)]
    split = [m for m, x in enumerate(optim) if mesh.size(m) > 1 and x.is_shard(d)]
    return split[: len(stored)] == stored


def _grads_to_masters(pairs, copy_out: bool, copies=None):
    """Each parameter's reduced gradient onto its master (copied when offloaded), and off the parameter."""
    copied = copies.take(pairs) if copies is not None else {}
    for p, master in pairs:
        g = p.grad
        if g is not None:
            if any(pl.is_partial() for pl in g.placements):  # (compiled blocks reduce to the storage layout)
                raise RuntimeError(
                    f"{p._spmd_name}: its gradient is still unreduced ({g.placements}); the last "
                    f"backward before a step must run outside spmd.no_sync"
                )
            if id(p) in copied:
                master.grad = copied[id(p)]
            elif copies is not None and id(p) in copies.master_of:
                master.grad = copies.copy_now(local_of(slice_onto_shards(g, master.placements)), master)
            else:
                master.grad = slice_onto_shards(g, master.placements).to(master.device, master.dtype, copy=copy_out)
        p.grad = None


@torch.no_grad()
def _stream_step(opt: torch.optim.Optimizer, pairs) -> None:
    """offload="nvme:DIR": steps one master at a time, gathers its update, releases its pages before the next."""
    step = type(opt).step.__wrapped__  # the step without its hooks: this runs inside them
    with tags.phase("optimizer"):
        for p, master in pairs:
            _grads_to_masters([(p, master)], copy_out=True)
            if master.grad is not None:
                step(opt)
                master.grad = None
            gather_into_param(master)
            release_pages(_file_tensors(opt, [master]))


def _file_tensors(opt, masters) -> list:
    return [t for m in masters for t in (m, *opt.state.get(m, {}).values()) if isinstance(t, torch.Tensor)]
