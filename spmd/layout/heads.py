"""Attention heads split whole: where tp splits the heads, each rank holds whole heads.

A projection's weight holds heads x head_dim rows, so its shape can divide by tp while its heads do not (28
query heads over tp=8, or 2 key/value heads over tp=4): a rank would hold part of a head, and the model's
reshape into heads fails deep inside its forward. The head counts come from the model's config, under the
names transformers (`num_attention_heads`, `num_key_value_heads`), nanoGPT (`n_head`) and models.llama
(`n_heads`, `n_kv_heads`) give them, and are checked before anything is laid out; the trainer checks a
config alone the same way (`config_problem`: config.json, a preset), before it builds the model. A model whose
config names neither is caught at that reshape instead (spmd.runtime.activations.global_view).
"""

import math

import torch.nn as nn

from .annotate import get_axes, out_dim

__all__ = ["check_heads_divide", "head_counts", "counts_in", "config_problem"]

_COUNT_NAMES = {
    "heads": ("num_attention_heads", "n_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads"),
}
_WHAT = {"heads": "attention heads", "kv_heads": "key/value heads"}


def counts_in(config) -> dict:
    """{"heads": n, "kv_heads": n} from a config (an object, or config.json's dict); key/value heads default
    to the query heads, as in transformers. Empty where the config names no head count."""

    def get(name):
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    counts = {}
    for logical, names in _COUNT_NAMES.items():
        n = next((v for a in names if isinstance(v := get(a), int)), None)
        if n is not None:
            counts[logical] = n
    if "heads" not in counts:
        return {}
    counts.setdefault("kv_heads", counts["heads"])
    return counts


def head_counts(model: nn.Module) -> dict:
    """`counts_in` of the model's config (`model.config`, else `model.cfg`)."""
    for config in (getattr(model, "config", None), getattr(model, "cfg", None)):
        counts = {} if config is None else counts_in(config)
        if counts:
            return counts
    return {}


def config_problem(config, sizes: dict, name: str) -> str | None:
    """Why a mesh of these sizes would split a head of the model `config` describes, with tp splitting its
    query and key/value heads (the default rules), or None: the check that needs no model built."""
    counts = counts_in(config)
    return _split_problem(name, counts, sizes, {logical: ["tp"] for logical in counts})


def _split_problem(name: str, counts: dict, sizes: dict, axes: dict) -> str | None:
    """The first of the head counts that the product of its mesh axes' sizes (`axes`: {logical: [mesh
    axis]}) does not divide, as a message naming the sizes that fit; None when all divide."""
    for logical in sorted(axes):
        split = [a for a in axes[logical] if sizes.get(a, 1) > 1]
        factor = math.prod(sizes[a] for a in split)
        n = counts[logical]
        if factor > 1 and n % factor:
            fits = [d for d in range(2, factor) if counts["heads"] % d == 0 and counts["kv_heads"] % d == 0]
            return (
                f"{name} has {n} {_WHAT[logical]}, which do not split over "
                f"{'x'.join(f'{a}={sizes[a]}' for a in split)}: a rank would hold part of a head. Pick a mesh "
                f"whose {' x '.join(split)} size divides both its {counts['heads']} query and "
                f"{counts['kv_heads']} key/value heads"
                + (f" ({', '.join(map(str, fits))})" if fits else f" (only 1 does: leave {' and '.join(split)} out)")
                + ", and give the rest of the world to dp or fsdp"
            )
    return None


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
    split = {logical: list(rules.compute.get(logical, ())) for logical in _split_axes(model) & counts.keys()}
    problem = _split_problem(type(model).__name__, counts, sizes, split)
    if problem is not None:
        raise ValueError(problem)
