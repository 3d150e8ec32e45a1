"""A Llama-style decoder on the global view: RMSNorm, RoPE, grouped-query attention, SwiGLU.

No distributed code lives here. Parameters carry logical axis names (`spmd.annotate`) and the residual
stream carries layout constraints (`spmd.constrain`); both do nothing until `spmd.parallelize` lays
the model out on a mesh, so this file runs as plain PyTorch on one device.
"""

import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from spmd import annotate, constrain
from spmd.layout.heads import config_problem


@dataclass
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 512
    ffn_dim: int = 128
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    kernels: str = "auto"  # "auto" | "torch" | "triton"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "LlamaConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)

    def build(self) -> "Llama":
        return Llama(self)

    def flops_per_token(self, seq_len: int) -> int:
        """6 N_non_embedding + 12 L H Q T: no recompute, no causal discount (L layers, H heads, Q head dim)."""
        return 6 * self.num_params(non_embedding=True) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def mesh_problem(self, sizes: dict) -> str | None:
        """Why a mesh of these axis sizes cannot lay this model out, or None: a tp that would split a head
        (tensor parallelism gives every rank whole heads)."""
        return config_problem(self, sizes, "Llama")

    def num_params(self, non_embedding: bool = False) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * d * self.ffn_dim + 2 * d
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        if non_embedding:
            return self.n_layers * block + d
        return self.n_layers * block + d + embed + head


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)
PRESETS = {
    "tiny": dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim=128, max_seq_len=256),
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim=768, max_seq_len=1024),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True, **_LLAMA3),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_LLAMA3),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA3),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, impl: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # axes inferred by spmd: follows `embed`
        self.eps, self.impl = eps, impl

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps, impl=self.impl)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        annotate(self.wq.weight, "heads", "embed")
        annotate(self.wk.weight, "kv_heads", "embed")
        annotate(self.wv.weight, "kv_heads", "embed")
        annotate(self.wo.weight, "embed", "heads")

    def forward(self, x, cos, sin):
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        q, k = kernels.apply_rope(q, k, cos, sin, impl=cfg.kernels)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        return self.wo(out.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.impl = cfg.kernels
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        annotate(self.w1.weight, "mlp", "embed")
        annotate(self.w3.weight, "mlp", "embed")
        annotate(self.w2.weight, "embed", "mlp")

    def forward(self, x):
        return self.w2(kernels.swiglu(self.w1(x), self.w3(x), impl=self.impl))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.feed_forward = FeedForward(cfg)

    def forward(self, h, cos, sin):
        h = h + constrain(self.attention(self.attention_norm(h), cos, sin), "batch", "seq", "embed")
        h = h + constrain(self.feed_forward(self.ffn_norm(h)), "batch", "seq", "embed")
        return h


def rope_tables(cfg: LlamaConfig):
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Llama(nn.Module):
    block_type = Block  # a variant swaps the block (models/moe.py)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        annotate(self.tok_embeddings.weight, "vocab", "embed")
        self.layers = nn.ModuleList(self.block_type(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        annotate(self.output.weight, "vocab", "embed")
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None):
        """Normal(0, 0.02) weights, output projections scaled by depth (GPT-2 style), unit norms; drawn from
        a generator seeded with `seed` (default: torch.initial_seed(), i.e. the last torch.manual_seed)."""
        init = self.initializer(seed)
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            with torch.no_grad():
                p.copy_(init(name, p))

    def initializer(self, seed: int | None = None):
        """fn(name, tensor) -> the initial value of parameter or buffer `name`, a function of (seed, name)
        alone: each tensor draws from its own generator, so any subset (a rank's shards, a pipeline stage's
        parameters) initialises in any order to the values `reset_parameters(seed)` gives. A model built on
        the meta device passes it to spmd.parallelize / spmd.build_pipeline as `param_init`."""
        base = torch.initial_seed() if seed is None else seed
        std = 0.02

        def init(name: str, t: torch.Tensor) -> torch.Tensor:
            if name in ("rope_cos", "rope_sin"):
                return rope_tables(self.cfg)[0 if name == "rope_cos" else 1]
            if name.endswith("norm.weight"):
                return torch.ones(t.shape, dtype=t.dtype, device="cpu")
            gen = torch.Generator().manual_seed((base * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            s = std / (2 * self.cfg.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else std
            return torch.randn(t.shape, generator=gen, dtype=t.dtype, device="cpu") * s

        return init

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """`positions` [B, T]: each token's position, when the sequence is given in another order than
        0..T-1 (context parallelism gives each rank a zigzag share of it); RoPE rotates by these."""
        h = self.embed(tokens)
        extra = self.block_inputs(h, positions)
        for layer in self.layers:
            h = layer(h, *extra)
        return self.head(h, targets)

    # The forward in three parts, which pipeline stages call on their share of the model (spmd.pipeline):
    # each uses only the attributes it names, so a stage holding those attributes can run it.
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> the residual stream [B, T, dim] (uses `tok_embeddings`)."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        return constrain(self.tok_embeddings(tokens), "batch", "seq", "embed")

    def block_inputs(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> tuple:
        """The arguments every block takes after the residual stream: the RoPE tables for this length, or
        [B, T, head_dim] tables looked up at `positions`."""
        if positions is not None:
            return F.embedding(positions, self.rope_cos), F.embedding(positions, self.rope_sin)
        T = h.shape[1]
        return self.rope_cos[:T], self.rope_sin[:T]

    def head(self, h: torch.Tensor, targets: torch.Tensor | None = None):
        """Final norm and output projection: logits, or the mean cross-entropy when targets are given."""
        logits = constrain(self.output(self.norm(h)), "batch", "seq", "vocab")
        if targets is None:
            return logits
        return kernels.cross_entropy(logits, targets, impl=self.cfg.kernels)
