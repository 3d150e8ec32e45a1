"""Attention heads split whole over tp: a mesh that would hand a rank part of a head is refused with the
head counts and the sizes that fit, before anything is laid out; a model whose config names no head count
gets the same diagnosis at the reshape into heads, naming the module. Attention with a whole mask runs on local
tensors only where its batch splits evenly over every axis that splits it."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from models.llama import Llama, LlamaConfig
from spmd.analysis.fake import fake_world

transformers = pytest.importorskip("transformers")


def _qwen3(heads: int, kv_heads: int):
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.Qwen3ForCausalLM(config)
    spmd.annotate_hf(model)
    return model


def test_heads_that_do_not_divide_by_tp_are_refused_before_any_layout():
    model = _qwen3(4, 2)
    before = [p.clone() for p in model.parameters()]
    with fake_world({"tp": 4}) as (mesh, _):
        with pytest.raises(
            ValueError,
            match=r"Qwen3ForCausalLM has 2 key/value heads, which do not split over "
            r"tp=4.*divides both its 4 query and 2 key/value heads \(2\)",
        ):
            spmd.parallelize(model, mesh, spmd.Rules.default())
    assert not hasattr(model, "_spmd_state")
    assert all(type(p) is nn.Parameter and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # models.llama's config names them n_heads / n_kv_heads; 6 query heads over fsdp x tp=4
    llama = Llama(LlamaConfig(dim=48, n_layers=1, n_heads=6, n_kv_heads=6, vocab_size=64, ffn_dim=96, max_seq_len=32))
    with fake_world({"fsdp": 2, "tp": 4}) as (mesh, _):
        with pytest.raises(ValueError, match=r"Llama has 6 attention heads, which do not split over tp=4.*\(2, 3\)"):
            spmd.parallelize(llama, mesh, spmd.Rules.default())
    # the planner says the same of that spec
    with pytest.raises(ValueError, match="6 attention heads"):
        spmd.explain(llama, spmd.Rules.default(), {"fsdp": 2, "tp": 4}, batch_shape=(4, 8))


def test_the_trainer_reads_the_same_counts_from_a_config_alone(tmp_path):
    """`launch.train` checks a mesh before it builds the model: from config.json (`--model hf:DIR`) or the
    preset's config, with the same counts and message as the check on the built model."""
    import models

    _qwen3(4, 2).config.save_pretrained(tmp_path)
    hf = models.preset(f"hf:{tmp_path}")
    assert re.search(
        r"qwen3 has 2 key/value heads, which do not split over tp=4.*\(2\).*config.json of",
        hf.mesh_problem({"fsdp": 2, "tp": 4}),
    )
    assert hf.mesh_problem({"fsdp": 4, "tp": 2}) is None
    llama = LlamaConfig(dim=48, n_layers=1, n_heads=6, n_kv_heads=6, vocab_size=64, ffn_dim=96, max_seq_len=32)
    assert re.search(
        r"Llama has 6 attention heads, which do not split over tp=4.*\(2, 3\)", llama.mesh_problem({"tp": 4})
    )


def _local_rows(model) -> dict:
    """{projection: (placements, local shape)} of the first layer's attention weights."""
    attn = model.model.layers[0].self_attn
    return {
        n: (tuple(w.placements), tuple(w._local_tensor.shape))
        for n, w in (("q", attn.q_proj.weight), ("k", attn.k_proj.weight), ("o", attn.o_proj.weight))
    }


def test_heads_that_divide_or_stay_whole_pass():
    """4 query and 2 key/value heads of head_dim 8 (dim 32) over tp=2: every rank holds 2 whole query heads and
    1 whole key/value head (the projections' rows, the output's columns); where no mesh axis splits the heads
    (dp=4) each rank holds them all. Kills the rules' `kv_heads` unmapped from tp (the key/value projections
    whole on every tp rank while the query heads split)."""
    with fake_world({"tp": 2}) as (mesh, _):
        model = spmd.parallelize(_qwen3(4, 2), mesh, spmd.Rules.default())
        assert _local_rows(model) == {
            "q": ((Shard(0),), (2 * 8, 32)),
            "k": ((Shard(0),), (1 * 8, 32)),
            "o": ((Shard(1),), (32, 2 * 8)),
        }
    with fake_world({"dp": 4}) as (mesh, _):  # no mesh axis splits the heads
        model = spmd.parallelize(_qwen3(4, 2), mesh, spmd.Rules.default())
        assert _local_rows(model) == {
            "q": ((Replicate(),), (32, 32)),
            "k": ((Replicate(),), (16, 32)),
            "o": ((Replicate(),), (32, 32)),
        }


class _Attention(nn.Module):
    """Self-attention written with its head count in a plain attribute, no config."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim, bias=False)
        for layer in self.qkv:
            spmd.annotate(layer.weight, "heads", "embed")
        spmd.annotate(self.out.weight, "embed", "heads")

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (layer(x).view(B, T, self.heads, D // self.heads).transpose(1, 2) for layer in self.qkv)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(64, 32)
        spmd.annotate(self.embedding.weight, "vocab", "embed")
        self.attention = _Attention(32, heads=2)

    def forward(self, tokens, targets=None):
        return self.attention(self.embedding(tokens)).square().mean()


def test_a_model_without_head_counts_gets_the_error_at_its_reshape():
    model = _Tiny()
    with pytest.raises(
        ValueError,
        match=r"^attention: viewing a tensor of shape \(2, 8, 32\), split over tp=4, as "
        r"\(2, 8, 2, 16\) splits a sharded dim into groups \(heads\)",
    ):
        spmd.explain(model, spmd.Rules.default(), {"tp": 4}, batch_shape=(2, 8))


def _masked_attention(rank, world):
    from torch.distributed.tensor import distribute_tensor

    from spmd.runtime.activations.global_view import _attention

    mesh = spmd.make_mesh({"dp": 2, "fsdp": 2})
    for batch in (8, 6):  # 6: split 3 / 3 over dp, then 2 / 1 over fsdp
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, 2, 4, 8) for _ in range(3))
        mask = torch.rand(batch, 1, 4, 4) > 0.3
        mask[..., 0] = True
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        split = [distribute_tensor(t, mesh, (Shard(0), Shard(0))) for t in (q, k, v)]
        try:
            got = _attention(*split, attn_mask=mask)
        except RuntimeError:  # DTensor's own attention refuses a plain mask: an error on every rank
            assert batch == 6
            continue
        assert got.shape == want.shape, (batch, got.shape)
        assert torch.allclose(got.full_tensor(), want, rtol=0, atol=1e-6), batch


def test_masked_attention_runs_locally_only_on_an_even_split():
    """Attention with a whole per-row mask, its batch split over dp and fsdp, on 4 processes: split evenly, each
    rank attends with its rows of the mask and the result equals one process's within 1e-6; split unevenly (6
    rows: 3 / 3, then 2 / 1) it is not run on local tensors, where each rank's slice of the mask and the
    output's global shape assume even chunks. Mutation that fails it (tried): checking each mesh axis's size
    against the whole batch rather than the product of the axes that split it."""
    from tests.dist_utils import run_distributed

    run_distributed(_masked_attention, 4, timeout_s=120)
