"""Expert parallelism: tokens go to their experts' ranks by all-to-all and come back the same way.

An expert module (the `experts` axis on dim 0, torchtitan's GroupedExperts) takes tokens sorted by expert and the
count per expert; its caller, the *routing region*, runs on this rank's tokens as plain tensors. Under `experts ->
ep` (ep among the batch axes, DeepSpeed-MoE's layout) each rank holds E/ep experts: all-to-alls of the counts and
tokens, the local experts (partial over tp, reduced after the region), the reverse all-to-all; backward mirrors
them, and `explain` takes the routing to be balanced. Self-routing modules: whole_experts, routed_dispatch.
"""

import contextlib

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial, Replicate

from ...layout.annotate import get_axes
from ...layout.mesh import mesh_sizes
from ..activations.moves import grad_layout, move
from ..dtensor.wrap import contiguous_stride
from .all_to_all import AllToAll, balanced_counts, exchange_counts
from .routed_dispatch import RoutedDispatch
from .whole_experts import balanced_grouped_products, check_whole, routes_itself

__all__ = ["EXPERTS", "expert_modules", "check_expert_layout", "install_expert_hooks", "balanced_routing"]

EXPERTS = "experts"


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: module} of the modules whose own parameters carry the `experts` axis."""
    return {
        name: m
        for name, m in model.named_modules()
        if any(EXPERTS in (get_axes(p) or ()) for p in m.parameters(recurse=False))
    }


@contextlib.contextmanager
def balanced_routing(model: nn.Module):
    """While open, forwards of `model` on fake tensors route equal shares to each expert (dropless: same FLOPs)."""

    def balance(module, args):
        x, counts, *rest = args
        return (x, balanced_counts(x.shape[0], counts.shape[0]), *rest) if is_fake(x) else None

    with contextlib.ExitStack() as hooks:  # each hook removed as it closes
        for m in expert_modules(model).values():
            for handle in balanced_grouped_products(m) if routes_itself(m) else [m.register_forward_pre_hook(balance)]:
                hooks.enter_context(handle)
        yield


def check_expert_layout(model: nn.Module, mesh, rules) -> None:
    """Raises ValueError naming the problem and the fix for an expert layout spmd does not support."""
    found = expert_modules(model)
    if not found:
        return
    target = rules.compute.get(EXPERTS, ())
    if target not in ((), ("ep",)):
        raise ValueError(
            f"rule experts -> {target}: experts may be split over the ep mesh axis only; "
            f"use Rules(..., {{'experts': 'ep'}}) (Rules.default has it)"
        )
    ep = dict(zip(mesh.mesh_dim_names, mesh.shape)).get("ep", 1)
    if ep > 1 and "ep" not in rules.batch_axes():
        raise ValueError(
            f"ep={ep} splits the experts but not the batch (batch -> {rules.batch_axes()}); expert "
            f"parallelism here also splits the data over ep: add 'ep' to the batch rule"
        )
    for name, module in found.items():
        if routes_itself(module):
            check_whole(name, module, mesh, rules, ep)
            continue
        if not name:
            raise ValueError(
                "the model itself holds the expert parameters; put them in a submodule that the "
                "routing code calls with (tokens sorted by expert, tokens per expert)"
            )
        for p_name, p in module.named_parameters(recurse=False):
            axes = get_axes(p) or ()
            if (
                not axes
                or axes[0] != EXPERTS
                or any(a in rules.compute.get(ax, ()) for ax in axes[1:] for a in rules.batch_axes())
            ):
                raise ValueError(
                    f"{name}.{p_name} with axes {axes}: an expert module's parameters carry "
                    f"'experts' on dim 0 and no batch mesh axis on the others; annotate it "
                    f"('experts', ...)"
                )
            if ep > 1 and p.shape[0] % ep:
                raise ValueError(
                    f"{name}.{p_name}: {p.shape[0]} experts do not divide by ep={ep}; use an ep "
                    f"that divides the number of experts"
                )


def install_expert_hooks(model: nn.Module, state) -> None:
    """Hooks routing regions and expert modules; called after the pass's hooks exist, so these run inside them."""
    modules = dict(model.named_modules())
    for name, module in expert_modules(model).items():
        if routes_itself(module):
            balanced_grouped_products(module)  # it runs on local tensors (spmd.runtime.local.blocks)
            if mesh_sizes(state.mesh).get("ep", 1) > 1:
                _hook(module, RoutedDispatch(state, name, module), with_kwargs=True)
            continue
        parent_name = name.rpartition(".")[0]
        # mesh dims splitting another dim than `experts` (tp on mlp): outputs and input gradients are partial there
        split = {
            m
            for p in module.parameters(recurse=False)
            for m, pl in enumerate(p._spmd_compute)
            if pl.is_shard() and pl.dim != 0 and state.mesh.size(m) > 1
        }
        _hook(modules[parent_name], _Region(parent_name, split))
        _hook(module, _Dispatch(state, name))


def _hook(module: nn.Module, hooks, with_kwargs: bool = False) -> None:
    """`hooks.enter` and `hooks.leave` around `module`'s forward, inside the hooks registered before them."""
    module.register_forward_pre_hook(hooks.enter, with_kwargs=with_kwargs)
    module.register_forward_hook(hooks.leave, prepend=True)


class _Region:
    """The routing region: DTensor inputs in as local tensors (batch shards kept), the output back as a DTensor."""

    def __init__(self, name: str, split: set[int]):
        self.name, self.split = name, split
        self.layouts: list = []

    def enter(self, module, args):
        layout = None
        local = []
        for a in args:
            if isinstance(a, DTensor):
                target = tuple(p if p.is_shard() and p.dim == 0 else Replicate() for p in a.placements)
                # the output, and the gradient on the way back, are partial over the split dims (reduced after)
                partial = [Partial() if m in self.split else p for m, p in enumerate(target)]
                layout = layout or (a.device_mesh, partial, a.shape)
                why = "bring each rank's tokens whole to its routing"
                a = move(a, target, self.name, why, grad_placements=grad_layout(a.placements))
                a = a.to_local(grad_placements=partial)
            local.append(a)
        self.layouts.append(layout)
        return tuple(local)

    def leave(self, module, args, output):
        layout = self.layouts.pop()
        if layout is None:
            return output
        mesh, placements, shape = layout
        out_shape = shape[:-1] + output.shape[-1:]
        return DTensor.from_local(
            output, mesh, placements, run_check=False, shape=out_shape, stride=contiguous_stride(out_shape)
        )


class _Dispatch:
    """The expert module: its parameters as local tensors, tokens to and from the experts' ranks over ep."""

    def __init__(self, state, name: str):
        self.name = name
        mesh = state.mesh
        self.ep = mesh_sizes(mesh)["ep"]
        self.group = mesh.get_group("ep") if self.ep > 1 else None
        self.batch_dims = {mesh.mesh_dim_names.index(a) for a in state.rules.batch_axes() if a in mesh.mesh_dim_names}
        self.pending: list = []

    def enter(self, module, args):
        for p_name, p in module.named_parameters(recurse=False):
            g = module.__dict__.get(p_name, p)  # the compute-layout gather the pass put there
            # each rank's tokens give a partial sum of the gradient over the batch axes that hold the expert whole
            grads = [
                Partial() if pl.is_replicate() and m in self.batch_dims else pl for m, pl in enumerate(g.placements)
            ]
            module.__dict__[p_name] = g.to_local(grad_placements=grads)
        x, counts = args[0], args[1]
        balanced = is_fake(x)  # explain: no data, so the plan assumes balanced routing
        if balanced:
            counts = balanced_counts(x.shape[0], counts.shape[0])
        if self.group is None:
            self.pending.append(None)
            return x, counts
        per_source, send, recv, note = exchange_counts(counts, balanced, self.group, self.name, "tokens")
        with unset_fake_temporarily():
            local_expert = torch.arange(per_source.shape[1]).repeat(self.ep).repeat_interleave(per_source.reshape(-1))
            order = local_expert.argsort(stable=True)  # arrived grouped by source rank: regroup by expert
            inverse, local_counts = order.argsort(), per_source.sum(0)
        x = AllToAll.apply(x, recv, send, self.group, self.name, "dispatch tokens to their experts' ranks" + note)
        self.pending.append((inverse, send, recv, note))
        return x[order], local_counts

    def leave(self, module, args, output):
        pending = self.pending.pop()
        if pending is None:
            return output
        inverse, send, recv, note = pending
        return AllToAll.apply(
            output[inverse], send, recv, self.group, self.name, "combine expert outputs on their tokens' ranks" + note
        )
