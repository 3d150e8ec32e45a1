"""Llama in Hugging Face terms: parameter names, config.json, and which tensors tied embeddings share.

Names (ours -> HF):
    tok_embeddings.weight                        model.embed_tokens.weight
    layers.N.attention.{wq,wk,wv,wo}.weight      model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.feed_forward.{w1,w2,w3}.weight      model.layers.N.mlp.{gate,down,up}_proj.weight
    layers.N.{attention_norm,ffn_norm}.weight    model.layers.N.{input_layernorm,post_attention_layernorm}.weight
    norm.weight                                  model.norm.weight
    output.weight                                lm_head.weight (absent when embeddings are tied)
Our RoPE uses HF's rotate-half layout, so q/k need no permutation.
"""

import re

import torch

from .llama import LlamaConfig

__all__ = ["MODEL_TYPE", "to_hf_name", "from_hf_name", "hf_config", "config_from_hf", "tied", "TIED_SOURCE"]

MODEL_TYPE = "llama"
TIED_SOURCE = {"lm_head.weight": "model.embed_tokens.weight"}  # an HF name read from another when tied


def tied(cfg: LlamaConfig) -> set[str]:
    """Our names a checkpoint does not hold because they share another tensor."""
    return {"output.weight"} if cfg.tie_embeddings else set()


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
_TOP = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]
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


def hf_config(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for transformers' LlamaForCausalLM from a LlamaConfig."""
    dt = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": dt,
        "dtype": dt,
    }


def config_from_hf(hf: dict) -> LlamaConfig:
    """LlamaConfig from an HF config.json's contents; rejects what our model lacks."""
    if hf.get("model_type") not in ("llama", None):
        raise ValueError(f"model_type {hf.get('model_type')!r} is not 'llama'; only Llama checkpoints load")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(
            f"rope scaling {scaling} is not implemented by models/llama.py; "
            "use a checkpoint with plain RoPE (no rope_scaling)"
        )
    unsupported = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']}")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        unsupported.append(f"head_dim={hf['head_dim']} != hidden_size/heads")
    if unsupported:
        raise ValueError(f"the Hugging Face config uses {unsupported}, which models/llama.py does not implement")
    return LlamaConfig(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
