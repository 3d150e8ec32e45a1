"""Hugging Face Llama interop: parameter names, config.json, and loading HF weights onto any mesh.

Names (ours -> HF):
    tok_embeddings.weight                        model.embed_tokens.weight
    layers.N.attention.{wq,wk,wv,wo}.weight      model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.feed_forward.{w1,w2,w3}.weight      model.layers.N.mlp.{gate,down,up}_proj.weight
    layers.N.{attention_norm,ffn_norm}.weight    model.layers.N.{input_layernorm,post_attention_layernorm}.weight
    norm.weight                                  model.norm.weight
    output.weight                                lm_head.weight (absent when embeddings are tied)
Our RoPE uses HF's rotate-half layout, so q/k need no permutation.

`load_hf(model, hf_dir)` fills the model's parameters (plain tensors or DTensors on any mesh) reading only
the slice each rank holds; `save_hf(tensors, model_cfg, out_dir)` writes config.json + safetensors, sharded
with `model.safetensors.index.json` past `max_shard_bytes`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spmd import checkpoint

_LAYER = [
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
]
_TOP = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight")]
_TO_HF = dict(_LAYER)
_FROM_HF = {v: k for k, v in _LAYER}


def to_hf_name(name: str) -> str:
    for ours, theirs in _TOP:
        if name == ours:
            return theirs
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _TO_HF:
        return f"model.layers.{m.group(1)}.{_TO_HF[m.group(2)]}"
    raise KeyError(f"parameter {name!r} has no Hugging Face Llama name")


def from_hf_name(name: str) -> str:
    for ours, theirs in _TOP:
        if name == theirs:
            return ours
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _FROM_HF:
        return f"layers.{m.group(1)}.{_FROM_HF[m.group(2)]}"
    raise KeyError(f"Hugging Face tensor {name!r} has no counterpart in models/llama.py")


# ---------------------------------------------------------------------------------------------- config.json
def hf_config(cfg, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for transformers' LlamaForCausalLM from a models.llama.LlamaConfig."""
    dt = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "torch_dtype": dt, "dtype": dt,
    }


def llama_config_from_hf(hf: dict | str | Path):
    """models.llama.LlamaConfig from an HF config.json (dict or path/dir); rejects what our model lacks."""
    from models.llama import LlamaConfig
    if not isinstance(hf, dict):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{path} does not exist; --init-from-hf needs a Hugging Face Llama directory "
                             "with config.json and *.safetensors")
        hf = json.loads(path.read_text())
    if hf.get("model_type") not in ("llama", None):
        raise ValueError(f"model_type {hf.get('model_type')!r} is not 'llama'; only Llama checkpoints load")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling} is not implemented by models/llama.py; "
                         "use a checkpoint with plain RoPE (no rope_scaling)")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']}")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        unsupported.append(f"head_dim={hf['head_dim']} != hidden_size/heads")
    if unsupported:
        raise ValueError(f"the Hugging Face config uses {unsupported}, which models/llama.py does not implement")
    return LlamaConfig(dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
                       ffn_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                       norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


# ---------------------------------------------------------------------------------------------- weights
def _weight_map(hf_dir: Path) -> dict[str, str]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise ValueError(f"{hf_dir} holds neither model.safetensors nor model.safetensors.index.json; "
                     "export weights as safetensors (pytorch_model.bin is not read: it is a pickle)")


def load_hf(model: torch.nn.Module, hf_dir: str | Path, strict: bool = True) -> list[str]:
    """Fill `model`'s parameters from a Hugging Face Llama directory; returns the HF names read.

    Works on any mesh: each rank reads only the slice of each tensor its (DTensor) parameters hold. An
    untied model loading a tied checkpoint takes `lm_head` from `embed_tokens`.
    """
    hf_dir = Path(hf_dir)
    weights = _weight_map(hf_dir)
    files: dict[str, object] = {}

    def open_file(name):
        if name not in files:
            files[name] = safe_open(str(hf_dir / name), framework="pt")
        return files[name]

    read, missing = [], []
    for name, target in checkpoint.model_state(model).items():
        key = to_hf_name(name)
        if key not in weights and key == "lm_head.weight":
            key = "model.embed_tokens.weight"  # tied in the checkpoint, untied here
        if key not in weights:
            missing.append(key)
            continue
        f = open_file(weights[key])
        shape = list(f.get_slice(key).get_shape())
        checkpoint.read_into(target, key, [{"file": weights[key], "offsets": [0] * len(shape), "lengths": shape}],
                             open_file, shape, name=f"{key} -> {name}")
        read.append(key)
    if strict:
        used = set(read) | ({"lm_head.weight"} if "lm_head.weight" in weights and
                            getattr(getattr(model, "cfg", None), "tie_embeddings", False) else set())
        unused = [k for k in weights if k not in used and not k.endswith("rotary_emb.inv_freq")]
        if missing or unused:
            raise KeyError(f"{hf_dir} does not match the model: missing {missing[:8]}, unused {unused[:8]}; "
                           "build the model from the directory's config.json (launch.hf.llama_config_from_hf)")
    return read


def save_hf(tensors, model_cfg, out_dir: str | Path, max_shard_bytes: int = 5 * 2 ** 30,
            dtype: torch.dtype | None = None) -> list[Path]:
    """Write config.json and weights under HF names.

    `tensors`: {our name: (global shape, dtype)} with a `fetch(name) -> full tensor` attribute, or simply a
    dict of full tensors. Shards above `max_shard_bytes` and writes model.safetensors.index.json then.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fetch = getattr(tensors, "fetch", None) or tensors.__getitem__
    names = [n for n in tensors if not (model_cfg.tie_embeddings and n == "output.weight")]
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
    out_dtype = dtype or next((tensors[n].dtype if isinstance(tensors[n], torch.Tensor) else tensors[n][1])
                              for n in names)
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg, out_dtype), indent=2))
    written, weight_map = [], {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for n in group:
            t = fetch(n).detach().to("cpu")
            shard[to_hf_name(n)] = (t.to(dtype) if dtype else t).contiguous()
            weight_map[to_hf_name(n)] = fname
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        written.append(out / fname)
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2))
    else:
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return written
