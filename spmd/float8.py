"""float8 training through torchao: `spmd.float8_training(model)` swaps a model's linear layers for torchao's
Float8Linear, whose three matmuls (output, input gradient, weight gradient) run in float8 with dynamic
tensorwise scales: each operand is scaled by max|x| over the whole tensor, cast to e4m3 (e5m2 for gradients),
multiplied, and the product unscaled.

Call it on the global-view model, before `spmd.parallelize` (or `spmd.build_pipeline`): the conversion swaps
modules, and the pass installs its hooks on the modules it finds. The layers keep their parameters, so
annotations, names and checkpoints are unchanged. Laid out by spmd, a Float8Linear sees what it sees on one
device, at the global view: its weight gathered to its compute layout (whole under dp/fsdp, a tp slice as a
DTensor), its input a DTensor. Its scales are maxima over the whole tensor (DTensor reduces a max over a
sharded tensor across the ranks holding it), so every rank casts with the one-device scale; that is why blocks
holding float8 layers keep the DTensor path rather than running on local tensors (spmd.runtime.local.blocks),
where a max would cover only this rank's slice of the batch.

The filter follows torchtitan's: the output head (`output`, `lm_head`) stays in high precision, and so does any
linear layer whose features do not divide by 16 (float8 matmuls need it) or are below `min_features`.
"""

from collections.abc import Iterable

import torch.nn as nn

from .layout.annotate import computes_in_float8
from .runtime.state import STATE_ATTR

__all__ = ["float8_training", "float8_layers", "float8_notes", "computes_in_float8", "INSTALL_HINT"]

INSTALL_HINT = "pip install torchao (or pip install 'spmd[float8]')"
SKIPPED_BY_DEFAULT = ("output", "lm_head")


def float8_training(
    model: nn.Module,
    *,
    emulate: bool = False,
    skip: Iterable[str] = SKIPPED_BY_DEFAULT,
    min_features: int = 0,
    config=None,
) -> nn.Module:
    """Swaps `model`'s eligible nn.Linear layers for torchao's Float8Linear (tensorwise dynamic scales), in
    place, and returns it. `emulate`: run the float8 numerics with high-precision matmuls (CPU, GPUs before
    sm89). `skip`: layer names (the last part of the name, or the whole name) kept in high precision.
    `config`: a torchao Float8LinearConfig, instead of the tensorwise default."""
    if hasattr(model, STATE_ATTR):
        raise ValueError(
            "float8_training must run before spmd.parallelize: it swaps linear layers for Float8Linear, and "
            "parallelize has already put its hooks on the old ones. Build the model, call "
            "spmd.float8_training(model), then spmd.parallelize(model, ...)"
        )
    Float8LinearConfig, convert = _torchao()
    skip = set(skip)
    eligible, refused = _eligible(model, skip, min_features)
    if not eligible and float8_layers(model):
        raise ValueError(
            f"float8_training: {type(model).__name__} already computes in float8 ({len(float8_layers(model))} "
            f"layers) and has no other linear layer to convert; convert a model once"
        )
    if not eligible:
        raise ValueError(
            f"float8_training: {type(model).__name__} has no linear layer to compute in float8 ("
            + ("; ".join(refused[:4]) or "it has no nn.Linear")
            + "). Float8 needs nn.Linear layers whose in and out features divide by 16; pass skip=() or a "
            "smaller min_features to convert more, or train without float8"
        )
    config = config or Float8LinearConfig(emulate=emulate)
    convert(model, module_filter_fn=lambda _, name: name in eligible, config=config)
    return model


def float8_layers(model: nn.Module) -> list[str]:
    """Names of the layers of `model` that compute in float8."""
    return [name for name, m in model.named_modules() if computes_in_float8(m)]


def float8_notes(model: nn.Module, sizes: dict) -> list[str]:
    """explain's note on the float8 layers of `model` on a mesh of `sizes`; [] when it has none."""
    layers = float8_layers(model)
    if not layers:
        return []
    rest = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in layers]
    data = [a for a in ("dp", "fsdp", "tp", "cp") if sizes.get(a, 1) > 1]
    return [
        f"{len(layers)} of {len(layers) + len(rest)} linear layers compute in float8 (torchao, tensorwise dynamic "
        f"scales: each operand cast to e4m3, gradients to e5m2, by max|x| over the whole tensor"
        + (
            f"; a cast of a tensor split over {'+'.join(data)} all-reduces its max there: the all_reduce rows"
            if data
            else ""
        )
        + ")"
        + (f"; in the compute dtype: {', '.join(rest[:3])}{' ...' if len(rest) > 3 else ''}" if rest else "")
    ]


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"float8 training needs torchao, which is not installed ({e}): {INSTALL_HINT}") from None
    return Float8LinearConfig, convert_to_float8_training


def _eligible(model: nn.Module, skip: set, min_features: int) -> tuple[set, list]:
    """(names of the linear layers to convert, why each other linear layer stays as it is)."""
    eligible, refused = set(), []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or computes_in_float8(m):
            continue
        if name in skip or name.rsplit(".", 1)[-1] in skip:
            refused.append(f"{name} is skipped (the output head stays in high precision)")
        elif m.in_features % 16 or m.out_features % 16:
            refused.append(f"{name} is {m.in_features}x{m.out_features}, not multiples of 16")
        elif min(m.in_features, m.out_features) < min_features:
            refused.append(f"{name} is {m.in_features}x{m.out_features}, below min_features={min_features}")
        else:
            eligible.add(name)
    return eligible, refused
