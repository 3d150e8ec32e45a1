"""Models written once on the global view, and the registry launch/ and the analysis tools find them in.

A model is one file here plus one entry in `MODELS`. Its config class carries what the tools ask of it:
`preset(name, **overrides)`, `build()` (the nn.Module), `flops_per_token(seq_len)`, `mesh_problem(sizes)`
(why a mesh cannot lay it out, or None), `num_params()`, `max_seq_len`, `vocab_size`, `to_dict()`.
`hf` is the module that maps it to and from Hugging Face checkpoints, if there is one.
"""

from dataclasses import dataclass

import torch.nn as nn

from . import llama, llama_hf, moe, transformers_lm

__all__ = ["ModelEntry", "MODELS", "DEFAULT", "entry", "preset", "config_from_dict"]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config: type  # the config dataclass (see the module docstring)
    model: type  # the nn.Module class, built from a config
    hf: object = None  # Hugging Face adapter module (MODEL_TYPE, to_hf_name, from_hf_name, hf_config,
    # config_from_hf, tied, TIED_SOURCE), or None


MODELS = {
    "llama": ModelEntry("llama", llama.LlamaConfig, llama.Llama, hf=llama_hf),
    "moe": ModelEntry("moe", moe.MoEConfig, moe.MoE),
    # transformers' own class, whichever config.json names: `--model hf:DIR`
    "hf": ModelEntry("hf", transformers_lm.TransformersConfig, nn.Module, hf=transformers_lm),
}
DEFAULT = "llama"


def entry(name_or_config) -> ModelEntry:
    """The entry of a model name ("llama") or of a config object."""
    if isinstance(name_or_config, str):
        if name_or_config not in MODELS:
            raise ValueError(f"unknown model {name_or_config!r}; choose one of {sorted(MODELS)}")
        return MODELS[name_or_config]
    for e in MODELS.values():
        if isinstance(name_or_config, e.config):
            return e
    raise ValueError(f"{type(name_or_config).__name__} is not the config of a registered model ({sorted(MODELS)})")


def preset(spec: str, **overrides):
    """The config of `MODEL:PRESET` ("llama:8b"), or of a preset named alone: one of the default model's
    ("8b") or one a model lists in its config's `PRESETS` ("moe-tiny")."""
    name, _, size = spec.rpartition(":")
    name = name or next((n for n, e in MODELS.items() if size in getattr(e.config, "PRESETS", {})), DEFAULT)
    return entry(name).config.preset(size, **overrides)


def config_from_dict(d: dict, name: str = DEFAULT):
    """A config from its `to_dict()` (as checkpoints store it); unknown keys are ignored."""
    cls = entry(name).config
    fields = cls.__dataclass_fields__
    return cls(**{k: v for k, v in d.items() if k in fields})
