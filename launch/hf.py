"""Hugging Face interop for the registered models: config.json, and loading HF weights onto any mesh.

Each model's names and config mapping live in its adapter (the registry's `hf` entry, e.g.
models/llama_hf.py). `load_hf(model, hf_dir)` fills the model's parameters (plain tensors or DTensors on any
mesh) reading only the slice each rank holds; `save_hf(tensors, model_cfg, out_dir)` writes config.json +
safetensors, sharded with `model.safetensors.index.json` past `max_shard_bytes`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import models
from spmd import checkpoint

__all__ = ["adapter", "config_from_hf", "load_hf", "save_hf"]


def adapter(cfg):
    """The Hugging Face adapter of a model config (its registry entry's `hf`)."""
    hf = models.entry(cfg).hf
    if hf is None:
        raise ValueError(f"{type(cfg).__name__} has no Hugging Face adapter in the model registry")
    return hf


def config_from_hf(hf: dict | str | Path):
    """The model config of an HF config.json (dict or path/dir), by its model_type; rejects what the model lacks."""
    where = "DIR"
    if not isinstance(hf, dict):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        where = path.parent
        if not path.is_file():
            raise ValueError(
                f"{path} does not exist; --init-from-hf needs a Hugging Face directory "
                "with config.json and *.safetensors"
            )
        hf = json.loads(path.read_text())
    known = [e.hf for e in models.MODELS.values() if e.hf is not None]
    match = next((a for a in known if a.MODEL_TYPE == hf.get("model_type")), None)
    if match is None and hf.get("model_type") is not None:
        raise ValueError(
            f"no registered model has model_type {hf['model_type']!r} (those with an adapter: "
            f"{sorted(a.MODEL_TYPE for a in known if a.MODEL_TYPE)}); train transformers' own class "
            f"with --model hf:{where}, or --model hf:DIR2 --init-from-hf {where} to start a model "
            f"of the same architecture from these weights"
        )
    return (match or models.entry(models.DEFAULT).hf).config_from_hf(hf)


# ---------------------------------------------------------------------------------------------- weights
def _weight_map(hf_dir: Path) -> dict[str, str]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise ValueError(
        f"{hf_dir} holds neither model.safetensors nor model.safetensors.index.json; "
        "export weights as safetensors (pytorch_model.bin is not read: it is a pickle)"
    )


def load_hf(model: torch.nn.Module, hf_dir: str | Path, strict: bool = True) -> list[str]:
    """Fill `model`'s parameters from a Hugging Face directory; returns the HF names read.

    Works on any mesh: each rank reads only the slice of each tensor its (DTensor) parameters hold. An
    untied model loading a tied checkpoint takes `lm_head` from `embed_tokens`.
    """
    hf_dir = Path(hf_dir)
    hf = adapter(model.cfg)
    weights = _weight_map(hf_dir)
    files: dict[str, object] = {}

    def open_file(name):
        if name not in files:
            files[name] = safe_open(str(hf_dir / name), framework="pt")
        return files[name]

    read, missing = [], []
    for name, target in checkpoint.model_state(model).items():
        key = hf.to_hf_name(name)
        if key not in weights and key in hf.TIED_SOURCE:
            key = hf.TIED_SOURCE[key]  # tied in the checkpoint, untied here
        if key not in weights:
            missing.append(key)
            continue
        f = open_file(weights[key])
        shape = list(f.get_slice(key).get_shape())
        checkpoint.read_into(
            target,
            key,
            [{"file": weights[key], "offsets": [0] * len(shape), "lengths": shape}],
            open_file,
            shape,
            name=f"{key} -> {name}",
        )
        read.append(key)
    if strict:
        used = set(read) | {hf.to_hf_name(n) for n in hf.tied(model.cfg)}
        unused = [k for k in weights if k not in used and not k.endswith("rotary_emb.inv_freq")]
        if missing or unused:
            raise KeyError(
                f"{hf_dir} does not match the model: missing {missing[:8]}, unused {unused[:8]}; "
                "build the model from the directory's config.json (launch.hf.config_from_hf)"
            )
    return read


def save_hf(
    tensors, model_cfg, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None
) -> list[Path]:
    """Write config.json and weights under HF names.

    `tensors`: {our name: (global shape, dtype)} with a `fetch(name) -> full tensor` attribute, or simply a
    dict of full tensors. Shards above `max_shard_bytes` and writes model.safetensors.index.json then.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = adapter(model_cfg)
    fetch = getattr(tensors, "fetch", None) or tensors.__getitem__
    names = [n for n in tensors if n not in hf.tied(model_cfg)]
    sizes = {}
    for n in names:
        shape, dt = (tensors[n].shape, tensors[n].dtype) if isinstance(tensors[n], torch.Tensor) else tensors[n]
        sizes[n] = int(torch.Size(shape).numel()) * (dtype or dt).itemsize
    groups, current, used = [], [], 0
    for n in names:
        if current and used + sizes[n] > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(n)
        used += sizes[n]
    groups.append(current)
    out_dtype = dtype or next(
        (tensors[n].dtype if isinstance(tensors[n], torch.Tensor) else tensors[n][1]) for n in names
    )
    (out / "config.json").write_text(json.dumps(hf.hf_config(model_cfg, out_dtype), indent=2))
    written, weight_map = [], {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for n in group:
            t = fetch(n).detach().to("cpu")
            shard[hf.to_hf_name(n)] = (t.to(dtype) if dtype else t).contiguous()
            weight_map[hf.to_hf_name(n)] = fname
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        written.append(out / fname)
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2)
        )
    else:
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return written
