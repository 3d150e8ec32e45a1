"""Expert modules that route their tokens themselves (transformers': `forward(hidden_states, top_k_index,
top_k_weights)`). They compute with whole experts (E/ep under ep: routed_dispatch) on plain local tensors, while the
router stays in the global view so a load-balancing loss sees every rank's logits. On fake tensors (explain) their
grouped products take the balanced routing as one batched product (torch's fake grouped product takes bf16 only).
"""

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from ...layout.annotate import get_axes

__all__ = ["routes_itself", "check_whole", "balanced_grouped_products"]


def routes_itself(module: nn.Module) -> bool:
    """Whether an expert module sorts its tokens itself: its forward takes other than two positional arguments."""
    return _positional(module) != 2


def _positional(module: nn.Module) -> int:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(module.forward).parameters.values())


def check_whole(name: str, module: nn.Module, mesh, rules, ep: int) -> None:
    """Refuses what a self-routing expert module cannot do: ep without (tokens, choices, weights), experts not
    dividing by ep, tp splitting its other dims."""
    if ep > 1:
        params = [p for p in module.parameters(recurse=False) if "experts" in (get_axes(p) or ())]
        if _positional(module) != 3:
            raise ValueError(
                f"ep={ep} would split the experts of {name} ({type(module).__name__}), whose forward "
                f"takes other than (hidden_states, top_k_index, top_k_weights); drop ep from the mesh: "
                f"fsdp shards these experts as it shards any parameter"
            )
        if params and params[0].shape[0] % ep:
            raise ValueError(
                f"{name}: {params[0].shape[0]} experts do not divide by ep={ep}; use an ep that "
                f"divides the number of experts"
            )
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    for p_name, p in module.named_parameters(recurse=False):
        split = [
            (ax, a)
            for ax in (get_axes(p) or ())
            if ax and ax != "experts"
            for a in rules.compute.get(ax, ())
            if sizes.get(a, 1) > 1
        ]
        if split:
            raise ValueError(
                f"{name}.{p_name}: its axis {split[0][0]!r} splits over {split[0][1]} in compute, but "
                f"{type(module).__name__} routes the tokens itself and computes with whole experts; "
                f"annotate its dims other than 'experts' with None (or 'embed', which fsdp shards "
                f"in storage only)"
            )


class _BalancedGroupedProducts(TorchFunctionMode):
    """A grouped product of tokens sorted by expert on fake tensors, as balanced routing groups them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in (torch._grouped_mm, F.grouped_mm)
            and is_fake(args[0])
            and args[0].dim() == 2
            and args[1].dim() == 3
            and kwargs.get("bias") is None
        ):
            x, w = args[0], args[1]
            groups, rows = w.shape[0], x.shape[0]
            per = -(-rows // groups)
            x = F.pad(x, (0, 0, 0, per * groups - rows)) if per * groups != rows else x
            return torch.bmm(x.view(groups, per, x.shape[1]), w).view(groups * per, w.shape[2])[:rows]
        return func(*args, **kwargs)


def balanced_grouped_products(module: nn.Module) -> list:
    """Hooks `module`'s grouped products on fake tensors to group as balanced routing would; returns the handles."""
    modes = []

    def enter(mod, args):
        if args and is_fake(args[0]):
            modes.append(_BalancedGroupedProducts())
            modes[-1].__enter__()

    def leave(mod, args, output):
        if args and is_fake(args[0]) and modes:
            modes.pop().__exit__(None, None, None)

    return [
        module.register_forward_pre_hook(enter),
        module.register_forward_hook(leave, prepend=True, always_call=True),
    ]
