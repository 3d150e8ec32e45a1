"""`annotate_hf(model)`: logical axes for the parameters of common Hugging Face causal LMs, by model type.

Each table maps parameter-name patterns to axes, as `annotate_by_name` takes them; biases and norm
weights are left to inference (a bias follows its weight's output axis, a norm follows `embed`).
Fused projections (GPT-2's `c_attn`, GPT-NeoX's `query_key_value`, Phi-3's `qkv_proj` and
`gate_up_proj`) keep their fused output dim whole (`None`): sharding it over tp would hand a rank a slice
of q and k and v rather than whole heads. They compute replicated over tp, and the row-parallel layer
after them takes its slice of their output locally; the backward gathers that slice's gradient
(`explain` lists the all-gather against the layer).
"""

import fnmatch

import torch.nn as nn

from .annotate import annotate, infer_axes

__all__ = ["annotate_hf", "PRESETS"]

_LLAMA = {
    "*embed_tokens.weight": ("vocab", "embed"),
    "*.q_proj.weight": ("heads", "embed"),
    "*.k_proj.weight": ("kv_heads", "embed"),
    "*.v_proj.weight": ("kv_heads", "embed"),
    "*.o_proj.weight": ("embed", "heads"),
    "*.gate_proj.weight": ("mlp", "embed"),
    "*.up_proj.weight": ("mlp", "embed"),
    "*.down_proj.weight": ("embed", "mlp"),
    "lm_head.weight": ("vocab", "embed"),
}
_PHI3 = {
    "*embed_tokens.weight": ("vocab", "embed"),
    "*.qkv_proj.weight": (None, "embed"),
    "*.o_proj.weight": ("embed", "heads"),
    "*.gate_up_proj.weight": (None, "embed"),
    "*.down_proj.weight": ("embed", "mlp"),
    "lm_head.weight": ("vocab", "embed"),
}
_GPT2 = {  # transformers' Conv1D stores weights [in, out]
    "*.wte.weight": ("vocab", "embed"),
    "*.wpe.weight": (None, "embed"),
    "*.attn.c_attn.weight": ("embed", None),
    "*.attn.c_proj.weight": ("heads", "embed"),
    "*.mlp.c_fc.weight": ("embed", "mlp"),
    "*.mlp.c_proj.weight": ("mlp", "embed"),
    "lm_head.weight": ("vocab", "embed"),
}
_NEOX = {
    "*.embed_in.weight": ("vocab", "embed"),
    "*.attention.query_key_value.weight": (None, "embed"),
    "*.attention.dense.weight": ("embed", "heads"),
    "*.mlp.dense_h_to_4h.weight": ("mlp", "embed"),
    "*.mlp.dense_4h_to_h.weight": ("embed", "mlp"),
    "embed_out.weight": ("vocab", "embed"),
    "lm_head.weight": ("vocab", "embed"),
}
_FALCON = {
    "*.word_embeddings.weight": ("vocab", "embed"),
    "*.self_attention.query_key_value.weight": (None, "embed"),
    "*.self_attention.dense.weight": ("embed", "heads"),
    "*.mlp.dense_h_to_4h.weight": ("mlp", "embed"),
    "*.mlp.dense_4h_to_h.weight": ("embed", "mlp"),
    "lm_head.weight": ("vocab", "embed"),
}
_OPT = {
    "*.embed_tokens.weight": ("vocab", "embed"),
    "*.embed_positions.weight": (None, "embed"),
    "*.q_proj.weight": ("heads", "embed"),
    "*.k_proj.weight": ("heads", "embed"),
    "*.v_proj.weight": ("heads", "embed"),
    "*.out_proj.weight": ("embed", "heads"),
    "*.fc1.weight": ("mlp", "embed"),
    "*.fc2.weight": ("embed", "mlp"),
    "lm_head.weight": ("vocab", "embed"),
}
_QWEN3 = {**_LLAMA, "*.q_norm.weight": (None,), "*.k_norm.weight": (None,)}  # a norm over each head (Gemma 3's too)
_OLMO2 = {**_LLAMA, "*.q_norm.weight": ("heads",), "*.k_norm.weight": ("kv_heads",)}  # over all heads at once
_STARCODER2 = {**_LLAMA, "*.mlp.c_fc.weight": ("mlp", "embed"), "*.mlp.c_proj.weight": ("embed", "mlp")}
_PHI = {
    **_LLAMA,
    "*.self_attn.dense.weight": ("embed", "heads"),
    "*.mlp.fc1.weight": ("mlp", "embed"),
    "*.mlp.fc2.weight": ("embed", "mlp"),
}
_GLM = {**_LLAMA, "*.mlp.gate_up_proj.weight": (None, "embed")}  # gate and up fused, as Phi-3's
# transformers' mixtures of experts: a router, then experts stacked [experts, out, in] that route the tokens
# themselves; each rank holds them whole (fsdp shards them in storage), see spmd.runtime.experts.dispatch
_EXPERTS = {
    "*.mlp.gate.weight": (None, "embed"),
    "*.mlp.experts.gate_up_proj": ("experts", None, "embed"),
    "*.mlp.experts.down_proj": ("experts", "embed", None),
    "*.mlp.shared_expert_gate.weight": (None, "embed"),
}
# gpt-oss: attention sinks (one logit per head), biased experts stored [experts, in, out]
_GPT_OSS = {
    **_LLAMA,
    "*.self_attn.sinks": ("heads",),
    "*.mlp.router.weight": (None, "embed"),
    "*.mlp.experts.gate_up_proj": ("experts", "embed", None),
    "*.mlp.experts.down_proj": ("experts", None, "embed"),
    "*.mlp.experts.*_bias": ("experts", None),
}
# DeepSeek's multi-head latent attention: the low-rank projections (and their norms) whole, the projections
# up from them split by heads
_MLA = {
    **_LLAMA,
    **_EXPERTS,
    "*.q_a_proj.weight": (None, "embed"),
    "*.q_a_layernorm.weight": (None,),
    "*.q_b_proj.weight": ("heads", None),
    "*.kv_a_proj_with_mqa.weight": (None, "embed"),
    "*.kv_a_layernorm.weight": (None,),
    "*.kv_b_proj.weight": ("heads", None),
}
PRESETS = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _QWEN3,
    "gemma": _LLAMA,
    "gemma3_text": _QWEN3,
    "granite": _LLAMA,
    "stablelm": _LLAMA,
    "cohere": _LLAMA,
    "olmo2": _OLMO2,
    "starcoder2": _STARCODER2,
    "phi": _PHI,
    "phi3": _PHI3,
    "gpt2": _GPT2,
    "gpt_neox": _NEOX,
    "opt": _OPT,
    "smollm3": _LLAMA,
    "olmo": _LLAMA,
    "olmo3": _OLMO2,
    "nemotron": _LLAMA,
    "seed_oss": _LLAMA,
    "arcee": _LLAMA,
    "exaone4": _QWEN3,
    "glm": _GLM,
    "glm4": _GLM,
    "gemma2": _LLAMA,
    "helium": _LLAMA,
    "falcon": _FALCON,
    "mixtral": {**_LLAMA, **_EXPERTS},
    "qwen2_moe": {**_LLAMA, **_EXPERTS},
    "qwen3_moe": {**_QWEN3, **_EXPERTS},
    "olmoe": {**_OLMO2, **_EXPERTS},
    "gpt_oss": _GPT_OSS,
    "glm4_moe": {**_LLAMA, **_EXPERTS},
    "ernie4_5_moe": {**_LLAMA, **_EXPERTS, "*.gate.moe_statics.e_score_correction_bias": (None, None)},
    "deepseek_v3": _MLA,
}

_HOW = (
    "pass a table of name patterns, e.g. spmd.annotate_hf(model, table={{'*.q_proj.weight': ('heads', 'embed'), "
    "'*.o_proj.weight': ('embed', 'heads'), ...}}), with one logical axis or None per dim"
)


def annotate_hf(model: nn.Module, table: dict | None = None) -> dict:
    """Annotates a Hugging Face model from the preset for its `config.model_type` (or from `table`) and
    returns the table used. Every parameter must end up annotated or inferable; the error names those that
    are not. Turns off the model's KV cache (`config.use_cache`), which serves generation, not training."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if table is None:
        if model_type not in PRESETS:
            raise ValueError(
                f"no annotation preset for {type(model).__name__} (model_type {model_type!r}); "
                f"presets exist for {sorted(PRESETS)}; " + _HOW.format()
            )
        table = PRESETS[model_type]
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, p in named.items():
        for pattern, axes in table.items():
            if fnmatch.fnmatchcase(name, pattern):
                annotate(p, *axes)
                break
    unmatched: list[str] = []
    infer_axes(model, unmatched)
    if unmatched:
        source = (
            "the table given"
            if model_type not in PRESETS or table is not PRESETS[model_type]
            else f"the {model_type!r} preset"
        )
        raise ValueError(
            f"{type(model).__name__}: no pattern in {source} matches these parameters and their "
            f"axes cannot be inferred: {unmatched}; " + _HOW.format()
        )
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return table
