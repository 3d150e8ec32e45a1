"""A model's key/value cache (transformers' `use_cache`) under the pass: a training call would only keep a second copy
of every layer's K/V, so it gets `use_cache=False` (as torchtitan), the config untouched; no_grad or eval calls
build the cache, so step-by-step decoding runs on the mesh. `generate` mixes DTensor logits with plain tensors: refused.
"""

import inspect
import warnings

import torch
import torch.nn as nn

__all__ = ["refuse_generate", "skip_cache_in_training"]


def skip_cache_in_training(model: nn.Module) -> None:
    """Makes every training call of `model` pass `use_cache=False`, if its forward takes `use_cache`."""
    if not _takes_use_cache(model):
        return

    def hook(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is False:
            return None
        if kwargs.get("use_cache"):
            warnings.warn(
                f"{type(module).__name__} was called with use_cache=True in training: the key/value "
                f"cache serves generation, so spmd trains without it (use_cache=False). Call under "
                f"torch.no_grad() or after model.eval() to build a cache",
                stacklevel=2,
            )
        return args, {**kwargs, "use_cache": False}

    model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def refuse_generate(model: nn.Module) -> None:
    """Replaces the model's `generate` (transformers' GenerationMixin) by a clear refusal."""
    if not callable(getattr(model, "generate", None)):
        return
    name = type(model).__name__

    def generate(*args, **kwargs):
        raise NotImplementedError(
            f"{name}.generate() does not run on a model laid out by spmd.parallelize: its logits come back as "
            f"DTensors, which generation's own code mixes with plain tensors. Generate on one process from the "
            f"trained weights (load {{k: v.full_tensor() for k, v in model.state_dict().items()}} into a fresh "
            f"model), or decode step by step: model(input_ids=ids, cache=cache) under torch.no_grad() in eval mode, "
            f"on a spec without sp (one new token does not split over tp)"
        )

    model.generate = generate


def _takes_use_cache(model: nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature (a C++ or compiled callable)
        return False
