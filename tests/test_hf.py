"""Hugging Face interop: exported weights + config.json give transformers' LlamaForCausalLM the same logits
as our model; load_hf fills plain and DTensor models; names map both ways."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from launch import hf
from models import llama_hf
from models.llama import Llama, LlamaConfig
from spmd import checkpoint

REPO = Path(__file__).resolve().parents[1]


def _model(tied: bool, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.preset("tiny", tie_embeddings=tied, kernels="torch", rope_theta=5000.0))
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    return model


def _hf_logits(transformers, hf_dir, tokens):
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    with torch.no_grad():
        return ref(tokens).logits


def test_names_round_trip():
    model = _model(tied=False)
    names = [n for n, _ in model.named_parameters()]
    hf_names = [llama_hf.to_hf_name(n) for n in names]
    assert "model.layers.1.self_attn.k_proj.weight" in hf_names and "lm_head.weight" in hf_names
    assert [llama_hf.from_hf_name(n) for n in hf_names] == names
    with pytest.raises(KeyError, match="no Hugging Face Llama name"):
        llama_hf.to_hf_name("layers.0.attention.rotary.weight")


@pytest.mark.parametrize("tied", [False, True])
def test_export_matches_transformers_logits(tmp_path, tied):
    transformers = pytest.importorskip("transformers")  # only this test needs it
    model = _model(tied)
    ckpt_dir = tmp_path / "ckpt"
    checkpoint.save(ckpt_dir, 5, checkpoint.model_state(model), meta={"model_config": model.cfg.to_dict()})
    out = tmp_path / "hf"
    # the CLI, with a shard size small enough to force several files and an index
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.export",
            "--ckpt",
            str(ckpt_dir),
            "--out",
            str(out),
            "--max-shard-size",
            "100KB",
        ],
        check=True,
        cwd=REPO,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == tied and config["num_key_value_heads"] == 4

    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(transformers, out, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # and back: a fresh model loads the HF directory exactly
    assert hf.config_from_hf(out) == LlamaConfig(**{**model.cfg.to_dict(), "kernels": "auto"})
    fresh = _model(tied, seed=1)
    hf.load_hf(fresh, out)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n


def test_untied_model_from_tied_checkpoint_and_errors(tmp_path):
    tied = _model(tied=True)
    hf.save_hf(dict(tied.named_parameters()), tied.cfg, tmp_path)
    untied = Llama(LlamaConfig.preset("tiny", rope_theta=5000.0))
    hf.load_hf(untied, tmp_path)
    assert torch.equal(untied.output.weight, tied.tok_embeddings.weight)
    small = Llama(LlamaConfig.preset("tiny", dim=32))
    with pytest.raises(ValueError, match=r"global shape \[512, 64\] but the target is \[512, 32\]"):
        hf.load_hf(small, tmp_path)
    with pytest.raises(ValueError, match="neither model.safetensors"):
        hf.load_hf(untied, tmp_path / "nowhere")
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="rope scaling"):
        hf.config_from_hf({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def _load_hf_sharded(rank, world, hf_dir):
    """load_hf onto DTensor parameters (each rank reads its slices) equals the full weights."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    reference = _model(tied=False)
    model = Llama(LlamaConfig.preset("tiny", rope_theta=5000.0))
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            dim = 1 if p.dim() == 2 else 0
            mod._parameters[name] = torch.nn.Parameter(distribute_tensor(torch.zeros_like(p), mesh, [Shard(dim)]))
    hf.load_hf(model, hf_dir)
    for (n, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert b.to_local().shape[-1] == a.shape[-1] // world or a.dim() == 1
        assert torch.equal(b.full_tensor(), a), n


@pytest.mark.slow
def test_load_hf_onto_dtensors(tmp_path):
    model = _model(tied=False)
    hf.save_hf(dict(model.named_parameters()), model.cfg, tmp_path)
    run_distributed(_load_hf_sharded, 2, str(tmp_path), timeout_s=120)
