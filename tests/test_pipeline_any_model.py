"""Pipeline parallelism for models spmd did not write: transformers' LlamaForCausalLM and MixtralForCausalLM
(its experts routing the tokens themselves) from tiny local config.json files (as `--model hf:DIR` builds
them) and a nanoGPT whose head is tied to its embedding through
`F.linear`. Neither has embed/block_inputs/head parts; spmd.build_pipeline cuts the model's own forward at
block boundaries (spmd/pipeline/cut.py) and lays each stage out with the other mesh axes.

One 4-process launch runs every case for 2 AdamW steps next to the same model in one process on the whole
batch: the loss, every gradient, the global gradient norm (a tied weight counted once) and every updated
parameter agree within 1e-5, norm-relative, in float32 (the second step's gradients, taken at the updated
parameters, and its update, reading Adam's stored moments, prove what a third step did). One case checkpoints
every block; on pp=4 the tied head's gradients are summed over a group of the first and last pp rank alone;
two cases then accumulate two steps, the first without gradient sync.
"""

import json

import pytest
import torch

import spmd
from tests.dist_utils import run_distributed
from tests.spmd_cases import local_slice, norm_rel_err
from tests.test_any_model import _TINY, NANOGPT, VOCAB, batch

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# "trainer": transformers' Llama as `launch.train --model hf:DIR` builds it (on meta, each rank initialising
# its stages' shards by name through the model's initializer)
CASES = {
    "trainer": [("pp=2,fsdp=2", "1f1b", 1, 2, "full")],
    "mixtral": [("pp=2,fsdp=2", "1f1b", 1, 2, "full")],
    "llama": [("pp=2,tp=2,sp", "interleaved-1f1b", 2, 2, "none")],
    "nanogpt": [
        ("pp=2,fsdp=2", "1f1b", 1, 2, "none"),
        ("pp=2,tp=2", "zero-bubble", 2, 2, "none"),
        ("pp=4", "1f1b", 1, 4, "none"),
    ],
}


def _build(kind: str, hf_dir: str):
    if kind == "nanogpt":
        from tests.nanogpt import GPT, GPTConfig

        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=4))
        spmd.annotate_by_name(model, NANOGPT)
        return model
    from models.transformers_lm import TransformersConfig

    torch.manual_seed(0)
    model = TransformersConfig(path=hf_dir, kernels="torch").build()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return model


def _loss(out):
    return out[1] if isinstance(out, tuple) else out  # nanoGPT returns (logits, loss)


def _pipeline_matches_one_device(rank, world, dirs):
    for kind, spec, schedule, v, M, ac in [(kind, *case) for kind, cases in CASES.items() for case in cases]:
        what = f"{kind} {spec} {schedule} v={v} ac={ac}"
        sizes, flags = spmd.parse_spec(spec)
        if kind in dirs:
            ref, pipe = _trainer_pipeline(world, dirs[kind], spec, schedule, M, ac)
        else:
            ref = _build(kind, dirs["trainer"])
            pipe = spmd.build_pipeline(
                _build(kind, dirs["trainer"]),
                spmd.make_mesh(sizes),
                spmd.Rules.default(sequence_parallel="sp" in flags),
                schedule=schedule,
                microbatches=M,
                virtual_stages=v,
                ac=ac,
            )
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6, fused=True)
        ref_params = dict(ref.named_parameters())
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, [n for n, _ in pipe.named_parameters()])
        assert set().union(*everyone) == set(ref_params), f"{what}: the stages do not hold the model's parameters"
        for step in range(2):
            tokens = batch(step)
            x, y = tokens[:, :-1], tokens[:, 1:]
            loss = pipe.step(local_slice(x, pipe.stage_mesh), local_slice(y, pipe.stage_mesh))
            ref_loss = _loss(ref(x, y))
            ref_loss.backward()
            assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item(), (what, step, loss, ref_loss)
            for name, p in pipe.named_parameters():
                err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
                assert err <= TOL, f"{what} step {step}: gradient of {name} off by {err:.2e}"
            norm, ref_norm = pipe.clip_grad_norm_(1e9), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            assert abs(norm.item() - ref_norm.item()) <= TOL * ref_norm.item(), (what, step, norm, ref_norm)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for name, p in pipe.named_parameters():
                err = norm_rel_err(p.full_tensor(), ref_params[name].detach())
                assert err <= TOL, f"{what} step {step}: parameter {name} off by {err:.2e}"
        if ac == "none" and v == 1:
            _accumulates(pipe, ref, what)
        if rank == 0:
            print(f"{what}: ok", flush=True)


def _trainer_pipeline(world, hf_dir, spec, schedule, M, ac):
    """(one-process model, pipeline) as launch.train builds them for --model hf:DIR."""
    from launch.config import load_config
    from launch.setup import build_model

    cfg = load_config(
        [
            "--model",
            f"hf:{hf_dir}",
            "--mesh",
            spec,
            "--pp-schedule",
            schedule,
            "--microbatches",
            str(M),
            "--ac",
            ac,
            "--kernels",
            "torch",
            "--batch-size",
            "8",
            "--seq-len",
            "16",
        ]
    )
    cfg.validate(world, cfg.model_config())
    pipe = build_model(cfg, cfg.model_config(), world, torch.device("cpu"))[4]
    torch.manual_seed(cfg.seed)
    return cfg.model_config().build(), pipe


def _accumulates(pipe, ref, what):
    """step(sync=False) then step(): the gradients of both batches summed, a tied one over its stages once."""
    for step in (3, 4):
        tokens = batch(step)
        x, y = tokens[:, :-1], tokens[:, 1:]
        pipe.step(local_slice(x, pipe.stage_mesh), local_slice(y, pipe.stage_mesh), sync=step == 4)
        _loss(ref(x, y)).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
        assert err <= TOL, f"{what}: accumulated gradient of {name} off by {err:.2e}"


def _tiny_llama_dir(path) -> str:
    path.mkdir()
    config = transformers.LlamaConfig(**{**_TINY, "num_hidden_layers": 4, "num_key_value_heads": 2})
    config.save_pretrained(path)
    assert not json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    return str(path)


def _tiny_mixtral_dir(path, router_logits: bool = False) -> str:
    path.mkdir()
    transformers.MixtralConfig(
        **{
            **_TINY,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": router_logits,
            "router_aux_loss_coef": 0.5,
        }
    ).save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_pipeline_of_models_without_parts_matches_one_device(tmp_path):
    dirs = {"trainer": _tiny_llama_dir(tmp_path / "llama"), "mixtral": _tiny_mixtral_dir(tmp_path / "mixtral")}
    run_distributed(_pipeline_matches_one_device, 4, dirs, timeout_s=300)


def test_pipeline_refuses_a_load_balancing_loss_over_all_layers(tmp_path):
    """transformers' load-balancing loss takes every layer's router logits at once, which stages holding some of
    the layers cannot compute: cutting such a model is refused, naming the setting to change."""
    from models.transformers_lm import TransformersConfig
    from spmd.pipeline.cut import trace_uses

    model = TransformersConfig(path=_tiny_mixtral_dir(tmp_path / "mixtral", router_logits=True)).build()
    with pytest.raises(ValueError, match="set output_router_logits to false"):
        trace_uses(model, "model.layers")
