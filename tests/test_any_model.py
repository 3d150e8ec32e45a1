"""Models spmd has never seen, laid out from parameter annotations alone: transformers' Llama, Mistral,
Qwen2, Qwen3, Gemma, Gemma 3, Granite, StableLM, Cohere, OLMo 2, Starcoder2, Phi, Phi-3, GPT-2, GPT-NeoX,
OPT, EXAONE 4, eleven more families of Llama's layers under other names (LLAMA_LIKE) and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4-MoE, ERNIE 4.5 MoE, DeepSeek-V3 (multi-head latent
attention) and gpt-oss (attention sinks, eager attention under a sliding window), with the router's
load-balancing loss in the loss (tiny configs built here, nothing downloaded), and a nanoGPT written without
spmd in mind (positions from `arange`, fused qkv, a head tied through `F.linear`). The families added with
Qwen3 have grouped key/value heads (8 query heads, 4 key/value); Mistral attends through a sliding-window mask
and a Llama through a padding mask whose padded tokens the loss ignores, rows unevenly.

Each model trains 2 fused AdamW steps (the trainer's) on 4 gloo processes, next to the same model in one process:
loss, every gradient and every parameter agree within 1e-5, norm-relative (the tolerance and its reasoning are those of
test_spmd_numerics; OPT, two Llama-like families and four more compare in float64, all in one launch, see
`_in_float64`). transformers' Llama and the nanoGPT run every spec; the other families the three that take every
path a family's annotations feed (data axes only, on local tensors with a replica group; heads and mlp split 4 ways;
fsdp x tp with the sequence-parallel regions). One launch runs several groups of models, each model on all its
group's specs. Two steps prove what a third did: the first compares the gradients and Adam's first update, the
second compares gradients taken at the updated parameters and an update that reads the moments the first stored.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from spmd.analysis.candidates import expert_count
from spmd.analysis.fake import fake_world
from spmd.layout.presets import PRESETS
from tests.dist_utils import run_distributed
from tests.spmd_cases import norm_rel_err, norm_rel_errs

transformers = pytest.importorskip("transformers")

TOL = 1e-5
STEPS = 2  # the second step's gradients and update prove the first update and Adam's stored moments
# gpt-oss's expert biases start at zero: after 2 steps they are 2 updates of size lr, where fsdp x tp's roundoff
# lands at 1.02e-5 of their norm; a third step grows them past it
STEPS_OF = {"gpt_oss": 3}
SPECS = ["dp=4", "fsdp=4", "dp=2,fsdp=2", "tp=4", "tp=4,sp", "fsdp=2,tp=2,sp"]
FAMILY_SPECS = ["dp=2,fsdp=2", "tp=4", "fsdp=2,tp=2,sp"]
# a family's own layers meet the mesh through tp (heads, fused projections, experts split over it); dp and fsdp
# treat every family's parameters alike: the Llama-like and expert families keep fsdp in fsdp=2,tp=2,sp, and
# dp=2,fsdp=2 runs for the families of test_model_matches_one_device
TP_SPECS = FAMILY_SPECS[1:]
BATCH, SEQ, VOCAB = 8, 16, 256
_GQA = dict(num_attention_heads=8, num_key_value_heads=4)  # head_dim 8: 2 query heads share a key/value head
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    attn_implementation="sdpa",
    bos_token_id=0,
    eos_token_id=0,
)
NANOGPT = {
    "wte.weight": ("vocab", "embed"),
    "wpe.weight": (None, "embed"),
    "*.attn.c_attn.weight": (None, "embed"),
    "*.attn.c_proj.weight": ("embed", "heads"),
    "*.mlp.c_fc.weight": ("mlp", "embed"),
    "*.mlp.c_proj.weight": ("embed", "mlp"),
}


def build(kind: str):
    """(model, loss_fn(model, tokens)) with seed-fixed weights; norm weights and biases made non-trivial.
    `KIND:by_name`: annotated by `spmd.annotate_by_name` with the family's preset table, which leaves the
    config (its default `use_cache=True`) as it is, instead of by `annotate_hf`."""
    kind, _, how = kind.partition(":")
    torch.manual_seed(0)
    if kind == "nanogpt":
        from tests.nanogpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=VOCAB))
        spmd.annotate_by_name(model, NANOGPT)
        return model, lambda m, tokens: m(tokens[:, :-1], tokens[:, 1:])[1]
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind in HF_FAMILIES:
        model = _tiny_hf(kind)
        for name, module in model.named_modules():
            if name.endswith("k_proj") and module.bias is not None:
                # the key bias shifts every score of a query alike, which softmax ignores: its gradient is
                # zero but for roundoff, which Adam would blow up into steps of size lr on both sides
                module.bias = None
    elif kind == "mixtral_one_sided":
        # a router of zeros: every token ties, and its top 2 lie on one ep rank; the experts loop over those hit,
        # so on the other ranks no input reaches the output
        model = _tiny_hf("mixtral")
        model.set_experts_implementation("eager")
        assert model.config._experts_implementation == "eager"
        for layer in model.model.layers:
            layer.mlp.gate.weight.data.zero_()
    elif kind == "mistral":  # a sliding window shorter than the sequence: attention under a mask
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**_TINY, **_GQA, "sliding_window": 6}))
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**(_TINY if kind == "llama" else {**_TINY, **_GQA}))
        )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    if how == "by_name":
        spmd.annotate_by_name(model, PRESETS[model.config.model_type])
    else:
        spmd.annotate_hf(model)
    if kind == "llama_padded":
        return model, _padded_loss
    return model, lambda m, tokens: m(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


def _padded_loss(model, tokens):
    """Each sequence right-padded by 0 to 7 tokens (read off its last token, so every rank pads its own rows
    as one device does): an attention mask that differs by row, and labels the loss ignores (-100) there."""
    ids = tokens[:, :-1]
    keep = torch.arange(ids.shape[1]) < ids.shape[1] - (tokens[:, -1:] % 8)
    return model(input_ids=ids, attention_mask=keep.long(), labels=ids.masked_fill(~keep, -100)).loss


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def adamw(params):
    """The trainer's AdamW: fused, which on DTensor parameters updates each rank's local shards
    (spmd.runtime.dtensor.fused_step); one device runs the same kernel on whole tensors."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6, fused=True)


def _local(t, mesh):
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    sizes = spmd.mesh_sizes(mesh)
    n = sizes["dp"] * sizes["fsdp"]
    r = coords.get("dp", 0) * sizes["fsdp"] + coords.get("fsdp", 0)
    return t[r * (t.shape[0] // n) : (r + 1) * (t.shape[0] // n)]


_REFERENCES = {}  # per process: one device's run of a model, the same for every spec it is compared on


def _reference(kind: str):
    """One device's STEPS AdamW steps of `kind` in the default dtype: per step (loss, {name: gradient or None}),
    and the parameters after the last step. Computed once per process and shared by the specs (each spec
    recomputed the same numbers before)."""
    key = (kind, torch.get_default_dtype())
    if key not in _REFERENCES:
        ref, loss_fn = build(kind)
        opt = adamw(ref.parameters())
        steps = []
        for step in range(STEPS_OF.get(kind.partition(":")[0], STEPS)):
            loss = loss_fn(ref, batch(step))
            loss.backward()
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
            steps.append((loss.item(), grads))
            opt.step()
            opt.zero_grad()
        _REFERENCES[key] = steps, {n: p.detach().clone() for n, p in ref.named_parameters()}
    return _REFERENCES[key]


def _matches_one_device(rank, world, kind, specs, tol=TOL):
    ref_steps, ref_params = _reference(kind)
    for spec in specs:
        sizes, flags = spmd.parse_spec(spec)
        mesh = spmd.make_mesh(sizes)
        model, loss_fn = build(kind)
        spmd.parallelize(model, mesh, spmd.Rules.default(sequence_parallel="sp" in flags))
        opt = adamw(model.parameters())
        for step, (ref_loss, ref_grads) in enumerate(ref_steps):
            loss = loss_fn(model, _local(batch(step), mesh))
            assert type(loss) is torch.Tensor, (kind, spec, type(loss))
            assert abs(loss.item() - ref_loss) <= tol * abs(ref_loss), (kind, spec, step, loss, ref_loss)
            loss.backward()
            grads = []
            for name, p in model.named_parameters():
                if ref_grads[name] is None:  # (Ernie's expert score bias: no gradient, on one device either)
                    assert p.grad is None, f"{kind} {spec}: {name} has a gradient, which one device does not"
                    continue
                grads.append((name, p.grad, ref_grads[name]))
            for name, err in norm_rel_errs(grads).items():
                assert err <= tol, f"{kind} {spec} step {step}: gradient of {name} off by {err:.2e}"
            opt.step()
            opt.zero_grad()
        for name, err in norm_rel_errs([(n, p, ref_params[n]) for n, p in model.named_parameters()]).items():
            assert err <= tol, f"{kind} {spec}: parameter {name} off by {err:.2e} after {len(ref_steps)} steps"
        if rank == 0:
            print(f"{kind} {spec}: ok", flush=True)


MODEL_GROUPS = [
    [
        (("llama", "nanogpt"), SPECS),
        (("llama_padded", "mistral", "gpt2", "qwen2", "qwen3", "gemma"), FAMILY_SPECS),
        (("granite", "stablelm", "cohere", "phi", "phi3", "gpt_neox"), FAMILY_SPECS),
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("groups", MODEL_GROUPS, ids=["every_spec_and_families"])
def test_model_matches_one_device(groups):
    """One launch runs several groups (a process's second model on a spec reuses DTensor's sharding rules decided
    for the first: a launch per model paid them again)."""
    run_distributed(_each_matches_one_device, 4, groups, timeout_s=900)


# layers that are Llama's under other names and settings: OLMo, OLMo 3 (norms over all heads, split with them),
# Nemotron (LayerNorm1P, squared ReLU), Seed-OSS, Arcee, SmolLM3, GLM and GLM-4 (gate and up fused, as
# Phi-3's), Gemma 2 (eager attention with soft-capped scores and logits), Helium, and Falcon (its fused
# query_key_value kept whole, as GPT-NeoX's; attention and MLP side by side)
LLAMA_LIKE = ("smollm3", "olmo", "olmo3", "nemotron", "seed_oss", "arcee", "glm", "glm4", "gemma2", "helium", "falcon")
# transformers' mixtures of experts (spmd.runtime.experts.whole_experts, spmd.runtime.experts.routed_dispatch under ep),
# the load-balancing loss in the loss where the family has one
MIXTURES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "glm4_moe", "ernie4_5_moe", "deepseek_v3")
# on ep: one of each form (a plain top-k router; a shared expert; experts called by keyword, with biases; a
# router with a score-correction bias and grouped top-k), and ranks whose experts get no token in a step
ON_EP = ("mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3", "mixtral_one_sided")


# compared in float64: in float32 their gradients land at 1.0-1.6e-5 of their norm on an AVX-512 machine, roundoff
IN_FLOAT64 = ("olmo3", "gemma2")


FAMILY_GROUPS = [
    # the mixtures after the Llama-like families: their attention and embeddings reuse those sharding rules
    [(tuple(k for k in LLAMA_LIKE if k not in IN_FLOAT64), TP_SPECS), (MIXTURES, TP_SPECS)],
    [(ON_EP, ["ep=4", "dp=2,ep=2", "ep=2,tp=2"])],
]


@pytest.mark.slow
@pytest.mark.parametrize("groups", FAMILY_GROUPS, ids=["llama_like_and_mixtures_of_experts", "experts_over_ep"])
def test_families_match_one_device(groups):
    """One launch runs every family of its groups on the group's specs (the Llama-like families of IN_FLOAT64 run
    in test_model_matches_one_device_in_float64's launch)."""
    run_distributed(_each_matches_one_device, 4, groups, timeout_s=900)


def _each_matches_one_device(rank, world, groups):
    torch.set_default_dtype(torch.float32)
    for kinds, specs in groups:
        for kind in kinds:
            _matches_one_device(rank, world, kind, specs)


ALL_SPECS = SPECS + ["fsdp=2,tp=2", "fsdp=8,tp=4,sp", "dp=2,fsdp=4,tp=4"]


def _collectives(plan):
    """What a step moves: (phase, module, kind, axes, bytes) of every collective, as a sorted list."""
    return sorted((c.phase, c.module, c.kind, c.axes, c.bytes, c.origin) for c in plan.collectives)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_constraint_points_are_hints(spec, monkeypatch):
    """models/llama.py with every `constrain` taken out issues the same collectives (module, kind, axes,
    count, bytes, and none implicit) as with them: the pass decides where partial sums are reduced."""
    import models.llama
    from tests.spmd_cases import tiny_model

    sizes, flags = spmd.parse_spec(spec)
    rules = spmd.Rules.default(sequence_parallel="sp" in flags)
    batch = (16, 32)
    hinted = spmd.explain(tiny_model(), rules, sizes, batch_shape=batch)
    monkeypatch.setattr(models.llama, "constrain", lambda x, *axes: x)
    bare = spmd.explain(tiny_model(), rules, sizes, batch_shape=batch)
    assert _collectives(bare) == _collectives(hinted)
    assert not [c for c in bare.collectives if c.origin == "implicit"]
    if sizes.get("tp", 1) > 1:  # the partial sums of wo, w2 and the embedding are reduced over tp
        kind = "reduce_scatter" if "sp" in flags else "all_reduce"
        assert (
            len(
                [
                    c
                    for c in bare.collectives
                    if c.kind == kind
                    and c.phase == "forward"
                    and c.axes == ("tp",)
                    and c.reason.startswith("reduce partial sums")
                ]
            )
            == 1 + 2 * 2
        )


HF_FAMILIES = (
    "opt",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3_text",
    "granite",
    "stablelm",
    "cohere",
    "olmo2",
    "starcoder2",
    "phi",
    "phi3",
    "gpt_neox",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "gpt_oss",
    "glm4_moe",
    "ernie4_5_moe",
    "deepseek_v3",
    "smollm3",
    "olmo",
    "olmo3",
    "nemotron",
    "seed_oss",
    "arcee",
    "exaone4",
    "glm",
    "glm4",
    "gemma2",
    "helium",
    "falcon",
)


# 2 experts per token, and the router's load-balancing loss in the loss (a global mean over the tokens)
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)


def _tiny_hf(model_type: str):
    c = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    gqa = {**c, **_GQA}
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, c),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, c),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, c),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {**c, "head_dim": 16}),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {**c, "pad_token_id": 0}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**gqa, "head_dim": 8}),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {**gqa, "head_dim": 8}),
        "granite": (
            transformers.GraniteConfig,
            transformers.GraniteForCausalLM,
            {
                **gqa,
                "embedding_multiplier": 2.0,
                "residual_multiplier": 0.5,
                "logits_scaling": 4.0,
                "attention_multiplier": 0.2,
            },
        ),
        "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM, gqa),
        "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, gqa),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, gqa),
        "starcoder2": (
            transformers.Starcoder2Config,
            transformers.Starcoder2ForCausalLM,
            {**gqa, "residual_dropout": 0.0, "embedding_dropout": 0.0},
        ),
        "phi": (transformers.PhiConfig, transformers.PhiForCausalLM, {**gqa, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, {**gqa, "pad_token_id": 0}),
        "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM, gqa),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, gqa),
        "nemotron": (transformers.NemotronConfig, transformers.NemotronForCausalLM, gqa),
        "seed_oss": (
            transformers.SeedOssConfig,
            transformers.SeedOssForCausalLM,
            {**gqa, "attention_dropout": 0.0, "residual_dropout": 0.0},
        ),
        "arcee": (transformers.ArceeConfig, transformers.ArceeForCausalLM, gqa),
        "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, gqa),
        "glm": (transformers.GlmConfig, transformers.GlmForCausalLM, {**gqa, "pad_token_id": 0}),
        "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM, {**gqa, "pad_token_id": 0}),
        "helium": (
            transformers.HeliumConfig,
            transformers.HeliumForCausalLM,
            {**gqa, "head_dim": 8, "pad_token_id": 0},
        ),
        "falcon": (
            transformers.FalconConfig,
            transformers.FalconForCausalLM,
            dict(
                vocab_size=VOCAB,
                hidden_size=64,
                ffn_hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_kv_heads=4,
                new_decoder_architecture=True,
                bias=False,
                attn_implementation="sdpa",
                pad_token_id=0,
            ),
        ),
        "gemma2": (
            transformers.Gemma2Config,
            transformers.Gemma2ForCausalLM,
            {**gqa, "head_dim": 8, "attn_implementation": "eager"},
        ),
        "gpt2": (
            transformers.GPT2Config,
            transformers.GPT2LMHeadModel,
            dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_implementation="sdpa"),
        ),
        "gpt_neox": (
            transformers.GPTNeoXConfig,
            transformers.GPTNeoXForCausalLM,
            {k: v for k, v in c.items() if k != "num_key_value_heads"},
        ),
        "mixtral": (
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            {**gqa, "num_local_experts": 4, **_MOE},
        ),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            transformers.Qwen3MoeForCausalLM,
            {**gqa, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 8, **_MOE},
        ),
        "qwen2_moe": (
            transformers.Qwen2MoeConfig,
            transformers.Qwen2MoeForCausalLM,
            {**gqa, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, **_MOE},
        ),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, {**gqa, "num_experts": 4, **_MOE}),
        "glm4_moe": (
            transformers.Glm4MoeConfig,
            transformers.Glm4MoeForCausalLM,
            {
                **gqa,
                "n_routed_experts": 4,
                "moe_intermediate_size": 32,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
                "head_dim": 8,
                **_MOE,
            },
        ),
        "ernie4_5_moe": (
            transformers.Ernie4_5_MoeConfig,
            transformers.Ernie4_5_MoeForCausalLM,
            {**gqa, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, **_MOE},
        ),
        "deepseek_v3": (
            transformers.DeepseekV3Config,
            transformers.DeepseekV3ForCausalLM,
            {
                **c,
                "moe_intermediate_size": 32,
                "n_routed_experts": 4,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "q_lora_rank": 32,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 8,
                "pad_token_id": 0,
                **_MOE,
            },
        ),
        "gpt_oss": (
            transformers.GptOssConfig,
            transformers.GptOssForCausalLM,
            {
                **gqa,
                "head_dim": 8,
                "num_local_experts": 4,
                "sliding_window": 6,
                **_MOE,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "attn_implementation": "eager",
            },
        ),
        "opt": (
            transformers.OPTConfig,
            transformers.OPTForCausalLM,
            dict(
                vocab_size=VOCAB,
                hidden_size=64,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                word_embed_proj_dim=64,
                dropout=0.0,
                attn_implementation="sdpa",
            ),
        ),
    }
    config_cls, model_cls, kwargs = configs[model_type]
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs, bos_token_id=0, eos_token_id=0))


def test_every_preset_trains_as_one_device_on_fsdp_tp_sp():
    """Every family with a preset is annotated by it and trained against one device on `fsdp=2,tp=2,sp` (and
    the other specs of its group) by one of the numerics launches above; a preset added without a family in
    them fails here."""
    on_fsdp_tp_sp = {
        kind
        for groups in (*MODEL_GROUPS, *FAMILY_GROUPS)
        for kinds, specs in groups
        if "fsdp=2,tp=2,sp" in specs
        for kind in kinds
    } | {kind for kind, specs in FLOAT64_RUNS if "fsdp=2,tp=2,sp" in specs}
    assert not set(PRESETS) - on_fsdp_tp_sp, sorted(set(PRESETS) - on_fsdp_tp_sp)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_presets_leave_dtensor_nothing_to_decide(model_type):
    """On a fake world of fsdp x tp x sp, DTensor decides nothing on its own, transformers' loss included: its
    cross-entropy on the vocab-sharded logits runs vocab-parallel (spmd.runtime.activations.loss), never
    gathering them."""
    model = _tiny_hf(model_type)
    spmd.annotate_hf(model)
    rules = spmd.Rules.default(sequence_parallel=True)
    plan = spmd.explain(model, rules, {"fsdp": 2, "tp": 2}, batch_shape=(4, 16))
    assert plan.comm_bytes() > 0
    assert not [c for c in plan.collectives if c.origin == "implicit"]


OPT_SPECS = ["dp=2,fsdp=2", "tp=4,sp", "fsdp=2,tp=2,sp"]
FLOAT64_RUNS = [
    *((kind, FAMILY_SPECS) for kind in ("gemma3_text", "olmo2", "starcoder2", "exaone4", *IN_FLOAT64)),
    ("opt", OPT_SPECS),
]


@pytest.mark.slow
def test_model_matches_one_device_in_float64():
    """In one launch (they share DTensor's decisions for float64 tensors, which a launch each paid again), on the
    family specs, loss, gradients and parameters after 2 steps within 4e-6 of one process in float64
    (transformers' norms stay float32, see `_in_float64`), with grouped key/value heads where the family has them:
    - Gemma 3 (an embedding scaled by a 0-d buffer, whose vocab-parallel partial sums stay partial), OLMo 2 (one
      norm over all key heads, split over tp), Starcoder2 (a bias on every projection), EXAONE 4 (per-head q/k
      norms after the projections), and the Llama-like families of IN_FLOAT64 (OLMo 3, Gemma 2);
    - OPT, whose blocks flatten (batch, seq) into one dim, which a sequence-sharded activation cannot follow: the
      pass gathers the sequence first (explain lists the all-gather against the block, none implicit inside it),
      and on a data-parallel spec and both sequence-parallel ones (OPT_SPECS) it matches one process."""
    model = _tiny_hf("opt")
    spmd.annotate_hf(model)
    plan = spmd.explain(model, spmd.Rules.default(sequence_parallel=True), {"tp": 4}, batch_shape=(BATCH, SEQ))
    gathers = [c for c in plan.collectives if c.reason.startswith("gather a sharded dim the model's view merges")]
    assert sorted(c.module for c in gathers) == ["model.decoder.layers.0", "model.decoder.layers.1"]
    assert not [c for c in plan.collectives if c.origin == "implicit" and c.module.startswith("model.decoder.")]
    run_distributed(_each_in_float64, 4, FLOAT64_RUNS, timeout_s=900)


def _each_in_float64(rank, world, runs):
    for kind, specs in runs:
        _in_float64(rank, world, kind, specs)


def _in_float64(rank, world, kind, specs):
    # in float32 a gradient lands at 1.0e-5 of its norm (OPT's biases, a key projection, an embedding; OLMo 3's
    # embedding at 1.03e-5 on an AVX-512 machine), the roundoff of sums over the tokens taken in another order.
    # In float64 the model's matmuls and sums agree far closer, but transformers' norms and loss still compute
    # in float32 (`x.float()`, `.to(torch.float32)`), whose roundoff reaches the gradients through them: 1.08e-6
    # at most (OLMo 3's query projection, Gemma 3's k_norm), so 4e-6 holds them with room and a wrong
    # reduction (an error of 1e-3 or more) still fails
    torch.set_default_dtype(torch.float64)
    _matches_one_device(rank, world, kind, specs, tol=4e-6)


@pytest.mark.parametrize(
    "sizes, table, expected",
    [
        ({"ep": 3, "fsdp": 2}, None, "model.layers.0.mlp.experts: 4 experts do not divide by ep=3"),
        (
            {"fsdp": 2, "tp": 2},
            {"*.mlp.experts.down_proj": ("experts", "embed", "mlp")},
            "model.layers.0.mlp.experts.down_proj: its axis 'mlp' splits over tp",
        ),
    ],
)
def test_experts_that_route_themselves_are_refused_a_split(sizes, table, expected):
    """transformers' experts sort the tokens themselves, so they compute whole experts on each rank (E/ep of
    them under ep): a mesh or an annotation that would split an expert is refused before anything is laid out,
    naming the fix."""
    model = _tiny_hf("mixtral")
    spmd.annotate_hf(model, table={**PRESETS["mixtral"], **(table or {})} if table else None)
    with pytest.raises(ValueError, match=expected):
        spmd.explain(model, spmd.Rules.default(), sizes, batch_shape=(6, 16))


def test_experts_that_route_themselves_split_over_ep():
    """Under ep each rank holds E/ep of transformers' experts, and every (token, choice) pair travels to its
    expert's rank and back by all-to-all: the plan names those exchanges, and the search offers ep."""
    model = _tiny_hf("mixtral")
    spmd.annotate_hf(model)
    plan = spmd.explain(model, spmd.Rules.default(), {"ep": 2, "fsdp": 2}, batch_shape=(4, 16))
    exchanges = [c for c in plan.collectives if c.kind == "all_to_all"]
    # per layer (2): the counts per expert, then tokens, weights and local expert indices out and the outputs
    # back; the tokens, weights and outputs again in backward
    assert len(exchanges) == 2 * (1 + 3 + 1 + 3)
    assert {c.module for c in exchanges} == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert expert_count(model) == 4  # the search offers ep dividing 4
    model = _tiny_hf("mixtral")
    spmd.annotate_hf(model)
    with fake_world({"ep": 4}) as (mesh, _):
        spmd.parallelize(model, mesh, spmd.Rules.default())
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[0] == 4 and experts.gate_up_proj._local_tensor.shape[0] == 1


def test_annotate_hf_errors_name_the_problem():
    class Unknown(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.PretrainedConfig()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"no annotation preset for Unknown .*annotate_hf\(model, table="):
        spmd.annotate_hf(Unknown())
    model = _tiny_hf("llama")
    model.model.layers[0].extra = torch.nn.Linear(64, 8, bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra\.weight \(8, 64\).*table="):
        spmd.annotate_hf(model)
    # a table passed in annotates what the preset does not know
    table = {**PRESETS["llama"], "*.extra.weight": (None, "embed")}
    assert spmd.annotate_hf(model, table=table) is table


def _checkpointing_the_spmd_way(rank, world):
    mesh = spmd.make_mesh({"dp": 2})
    model, loss_fn = build("llama")
    model.activation_checkpointing_enable()
    with pytest.raises(
        ValueError,
        match=r"activation checkpointing on \(in 3 modules, model\.layers\.1 among them\).*"
        r"activation_checkpointing_disable\(\).*apply_activation_checkpointing",
    ):
        spmd.parallelize(model, mesh, spmd.Rules.default())
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # refused before anything changed
    ref, _ = build("llama")
    ref.activation_checkpointing_enable()
    model.activation_checkpointing_disable()
    spmd.parallelize(model, mesh, spmd.Rules.default())
    assert spmd.apply_activation_checkpointing(model, "full") == [0, 1]
    tokens = batch(0)
    loss, ref_loss = loss_fn(model, _local(tokens, mesh)), loss_fn(ref, tokens)
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert norm_rel_err(p.grad.full_tensor(), q.grad) <= TOL, name


def test_transformers_activation_checkpointing_is_refused_for_spmds_own():
    """transformers' recompute would run a layer past the pass's hooks (a DTensor met a plain tensor deep in
    backward); the error names the switch, and spmd's checkpointing of the same layers equals transformers'."""
    run_distributed(_checkpointing_the_spmd_way, 2, timeout_s=180)


@pytest.mark.parametrize("spec", ["fsdp=4", "dp=2,fsdp=2", "tp=4", "tp=4,sp", "fsdp=2,tp=2,sp"])
def test_transformers_llama_moves_what_models_llama_moves(spec):
    """transformers' LlamaForCausalLM and models/llama.py of the same shape issue the same planned
    collectives (phase, kind, axes, count, bytes per rank), the loss's included: the same layout at the same
    cost, transformers' cross-entropy running vocab-parallel as models/llama.py's does."""
    from tests.spmd_cases import tiny_model

    ours = tiny_model()
    cfg = ours.cfg
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.dim,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            max_position_embeddings=cfg.max_seq_len,
            attn_implementation="sdpa",
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    spmd.annotate_hf(theirs)
    sizes, flags = spmd.parse_spec(spec)
    rules = spmd.Rules.default(sequence_parallel="sp" in flags)

    def moved(model):
        plan = spmd.explain(model, rules, sizes, batch_shape=(8, 32))
        return sorted((c.phase, c.kind, c.axes, c.bytes) for c in plan.collectives)

    expected = moved(ours)
    assert expected and moved(theirs) == expected


def _real_step_records(rank, world, spec, expected):
    from collections import Counter

    from spmd.analysis.record import CollectiveRecorder

    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    model, loss_fn = build("llama")
    spmd.parallelize(model, mesh, spmd.Rules.default(sequence_parallel="sp" in flags))
    recorder = CollectiveRecorder(mesh)
    with recorder:
        loss_fn(model, _local(batch(0), mesh)).backward()
    got = Counter((c.module, c.kind, c.axes, c.bytes, c.phase, c.origin) for c in recorder.records)
    assert got == expected, f"{spec}: real run minus plan {got - expected}, plan minus real run {expected - got}"


@pytest.mark.slow
def test_plan_lists_the_collectives_of_a_real_step_of_transformers_llama():
    """explain on a fake world and a real 4-process step of transformers' LlamaForCausalLM issue the same
    collectives, record for record (module, kind, mesh axes, bytes, phase, origin)."""
    from collections import Counter

    spec = "fsdp=2,tp=2,sp"
    sizes, flags = spmd.parse_spec(spec)
    model, _ = build("llama")
    plan = spmd.explain(model, spmd.Rules.default(sequence_parallel=True), sizes, batch_shape=(BATCH, SEQ))
    expected = Counter((c.module, c.kind, c.axes, c.bytes, c.phase, c.origin) for c in plan.collectives)
    run_distributed(_real_step_records, 4, spec, expected, timeout_s=240)


@pytest.mark.parametrize("router_logits", [True, False])
def test_trainer_loss_of_a_mixture_of_experts_adds_its_load_balancing_loss(tmp_path, router_logits):
    """`--model hf:DIR` of a Mixtral: the trainer's loss is the cross-entropy of its targets plus the router's
    load-balancing loss times `router_aux_loss_coef` where the config asks for it, as transformers adds it to
    its own loss; FLOPs count the 2 experts of 4 each token passes through."""
    import torch.nn.functional as F

    import models

    config = transformers.MixtralConfig(
        **{**_TINY, **_GQA, **_MOE, "num_local_experts": 4, "output_router_logits": router_logits}
    )
    config.save_pretrained(tmp_path)
    cfg = models.preset(f"hf:{tmp_path}")
    torch.manual_seed(0)
    model = cfg.build()
    torch.manual_seed(0)
    ref = transformers.MixtralForCausalLM(config)
    tokens = batch(0)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    out = ref(input_ids=tokens[:, :-1])
    expected = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
    if router_logits:
        assert out.aux_loss > 0.5
        expected = expected + 0.5 * out.aux_loss
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item(), (loss.item(), expected.item())
    experts = sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n)
    assert cfg.num_params(active=True) == sum(p.numel() for p in ref.parameters()) - experts // 2
