"""Attention heads split whole: where tp splits the heads, each rank holds whole heads.

A projection's weight holds heads x head_dim rows, so its shape can divide by tp while its heads do not (28
query heads over tp=8, or 2 key/value heads over tp=4): a rank would hold part of a head, and the model's
reshape into heads fails deep inside its forward. The head counts come from the model's config, under the
names transformers (`num_attention_heads`, `num_key_value_heads`), nanoGPT (`n_head`) and models.llama
(`n_heads`, `n_kv_heads`) give them, and are checked before anything is laid out. A model whose config
names neither is caught at that reshape instead (spmd.runtime.plain).
"""
import math

import torch.nn as nn

from .annotate import get_axes, out_dim

__all__ = ["check_heads_divide", "head_counts"]

_COUNT_NAMES = {"heads": ("num_attention_heads", "n_heads", "n_head"),
                "kv_heads": ("num_key_value_heads", "n_kv_heads")}
_WHAT = {"heads": "attention heads", "kv_heads": "key/value heads"}


def head_counts(model: nn.Module) -> dict:
    """{"heads": n, "kv_heads": n} from the model's config (`model.config`, else `model.cfg`); key/value
    heads default to the query heads, as in transformers. Empty where the config names no head count."""
    for config in (getattr(model, "config", None), getattr(model, "cfg", None)):
        if config is None:
            continue
        counts = {}
        for logical, names in _COUNT_NAMES.items():
            n = next((getattr(config, a) for a in names if isinstance(getattr(config, a, None), int)), None)
            if n is not None:
                counts[logical] = n
        if "heads" in counts:
            counts.setdefault("kv_heads", counts["heads"])
            return counts
    return {}


def _split_axes(model: nn.Module) -> set:
    """The logical axes among heads / kv_heads that some layer's output features carry (a projection into
    heads, which the model then reshapes)."""
    found = set()
    for module in model.modules():
        dim = out_dim(module)
        weight = module._parameters.get("weight")
        axes = get_axes(weight) if weight is not None and dim is not None else None
        if axes and len(axes) > dim and axes[dim] in _COUNT_NAMES:
            found.add(axes[dim])
    return found


def check_heads_divide(model: nn.Module, sizes: dict, rules) -> None:
    """Raises a ValueError naming the head count and the mesh axes when the compute map splits a model's
    heads over mesh axes whose sizes do not divide it. `sizes`: {mesh axis: size}."""
    counts = head_counts(model)
    for logical in sorted(_split_axes(model) & counts.keys()):
        axes = [a for a in rules.compute.get(logical, ()) if sizes.get(a, 1) > 1]
        factor = math.prod(sizes[a] for a in axes)
        n = counts[logical]
        if factor > 1 and n % factor:
            split = "x".join(f"{a}={sizes[a]}" for a in axes)
            fits = [d for d in range(2, factor) if counts["heads"] % d == 0 and counts["kv_heads"] % d == 0]
            raise ValueError(
                f"{type(model).__name__} has {n} {_WHAT[logical]}, which do not split over {split}: a rank would "
                f"hold part of a head. Pick a mesh whose {' x '.join(axes)} size divides both its "
                f"{counts['heads']} query and {counts['kv_heads']} key/value heads"
                + (f" ({', '.join(map(str, fits))})" if fits else f" (only 1 does: leave {' and '.join(axes)} out)")
                + ", and give the rest of the world to dp or fsdp")
