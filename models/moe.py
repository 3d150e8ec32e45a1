"""A Mixtral-style mixture-of-experts decoder on the global view: Llama attention, then a top-k router
over E SwiGLU experts (and an optional shared expert that every token passes through).

Dropless: every token reaches each of its top-k experts, however uneven the routing (no capacity factor,
nothing dropped), so one device and any layout compute the same function. Each token's k expert outputs
are weighted by its softmax probabilities renormalised over the k chosen (as Mixtral does).
The loss adds, per layer, `aux_loss_coef` x the load-balancing loss E/k * sum_e f_e * P_e (f_e: the share
of tokens that chose expert e, P_e: its mean router probability; 1 when balanced) and `z_loss_coef` x the
router z-loss, the mean squared logsumexp of the router logits (ST-MoE).

Expert weights are stacked tensors `[experts, mlp, embed]` (`w2`: `[experts, embed, mlp]`) in
`GroupedExperts`, whose forward takes the tokens sorted by expert and the count per expert. `RoutedExperts`
sorts, calls it and combines, treating every token on its own, so spmd can run it on each rank's tokens
and dispatch them to the experts' ranks (spmd.runtime.experts). No distributed code lives here.
"""

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn as nn

import kernels
from spmd import annotate, constrain
from spmd.layout.heads import config_problem

from .llama import Attention, FeedForward, Llama, RMSNorm

__all__ = ["MoEConfig", "MoE", "MoEFeedForward", "RoutedExperts", "GroupedExperts", "PRESETS"]


@dataclass
class MoEConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 512
    n_experts: int = 8
    top_k: int = 2
    expert_dim: int = 64  # hidden size of each routed expert
    shared_expert_dim: int = 0  # hidden size of the shared expert; 0: none
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    kernels: str = "auto"
    PRESETS: ClassVar[dict] = {}

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:  # the shared expert is a Llama FeedForward of this width
        return self.shared_expert_dim

    @classmethod
    def preset(cls, name: str, **overrides) -> "MoEConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)

    def build(self) -> "MoE":
        return MoE(self)

    def flops_per_token(self, seq_len: int) -> int:
        """6 N_active_non_embedding + 12 L H Q T: the parameters a token passes through (k experts)."""
        return (
            6 * self.num_params(non_embedding=True, active=True)
            + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        )

    def mesh_problem(self, sizes: dict) -> str | None:
        """Why a mesh cannot lay this model out, or None: tp splits whole heads, ep whole experts."""
        problem = config_problem(self, sizes, "MoE")
        if problem is not None:
            return problem
        ep = sizes.get("ep", 1)
        if ep > 1 and self.n_experts % ep:
            fits = [d for d in range(1, self.n_experts + 1) if self.n_experts % d == 0]
            return (
                f"ep={ep} does not divide n_experts={self.n_experts}; every rank holds whole experts: use ep in {fits}"
            )
        return None

    def num_params(self, non_embedding: bool = False, active: bool = False) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        experts = self.top_k if active else self.n_experts
        block = attn + d * self.n_experts + 3 * d * (experts * self.expert_dim + self.shared_expert_dim) + 2 * d
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.n_layers * block + d + (0 if non_embedding else embed + head)


PRESETS = {
    "moe-tiny": dict(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        n_experts=8,
        top_k=2,
        expert_dim=64,
        shared_expert_dim=64,
        max_seq_len=256,
    ),
    "moe-small": dict(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        n_experts=8,
        top_k=2,
        expert_dim=512,
        max_seq_len=1024,
    ),
    # Mixtral 8x7B's shape
    "moe-8x7b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        n_experts=8,
        top_k=2,
        expert_dim=14336,
        max_seq_len=32768,
        rope_theta=1e6,
    ),
}
MoEConfig.PRESETS = PRESETS


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored stacked. forward(x sorted by expert [n, dim], tokens per expert [E]) -> [n, dim]."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.impl = cfg.kernels
        e, f, d = cfg.n_experts, cfg.expert_dim, cfg.dim
        self.w1 = annotate(nn.Parameter(torch.empty(e, f, d)), "experts", "mlp", "embed")  # gate
        self.w3 = annotate(nn.Parameter(torch.empty(e, f, d)), "experts", "mlp", "embed")  # up
        self.w2 = annotate(nn.Parameter(torch.empty(e, d, f)), "experts", "embed", "mlp")  # down

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(x.split(tokens_per_expert.tolist())):
            h = kernels.swiglu(chunk @ self.w1[e].T, chunk @ self.w3[e].T, impl=self.impl)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs)


class RoutedExperts(nn.Module):
    """Sends each token to its k chosen experts and sums their outputs, weighted. Every token is treated on
    its own (sorted by expert, computed grouped, put back), so any subset of tokens can run it alone."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.experts = GroupedExperts(cfg)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim], weights and chosen (expert ids) [B, T, k] -> [B, T, dim]."""
        k = chosen.shape[-1]
        flat = x.reshape(-1, x.shape[-1])
        ids = chosen.reshape(-1)
        order = ids.argsort(stable=True)  # (token, choice) pairs grouped by expert
        # a scatter rather than bincount: its shape does not depend on the data, so fake tensors run it
        counts = torch.zeros(self.n_experts, dtype=ids.dtype, device=ids.device).scatter_add_(
            0, ids, torch.ones_like(ids)
        )
        y = self.experts(flat[order // k], counts) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, order // k, y).view(x.shape)


class MoEFeedForward(nn.Module):
    """Router, routed experts and optional shared expert. After each forward, `aux_loss` holds this layer's
    weighted router losses and `tokens_per_expert` how many tokens chose each expert."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        annotate(self.router.weight, None, "embed")  # every rank routes its tokens over all experts
        self.routed = RoutedExperts(cfg)
        self.shared = FeedForward(cfg) if cfg.shared_expert_dim else None
        self.aux_loss = self.tokens_per_expert = None

    def forward(self, x):
        cfg = self.cfg
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(cfg.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = self.routed(x, weights.to(x.dtype), chosen)
        if self.shared is not None:
            out = out + self.shared(x)
        picks = (chosen.unsqueeze(-1) == torch.arange(cfg.n_experts, device=chosen.device)).sum(-2)
        share = constrain(picks.float().mean((0, 1)), None)  # f_e, summing to k
        mean_prob = constrain(probs.mean((0, 1)), None)  # P_e
        balance = (share * mean_prob).sum() * (cfg.n_experts / cfg.top_k)
        z = constrain(torch.logsumexp(logits, -1).square().mean())
        self.aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        self.tokens_per_expert = picks.detach().sum((0, 1))
        return out


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.feed_forward = MoEFeedForward(cfg)

    def forward(self, h, cos, sin):
        h = h + constrain(self.attention(self.attention_norm(h), cos, sin), "batch", "seq", "embed")
        h = h + constrain(self.feed_forward(self.ffn_norm(h)), "batch", "seq", "embed")
        return h


class MoE(Llama):
    """The Llama decoder with MoE blocks; its loss adds every layer's router losses to the cross-entropy."""

    block_type = MoEBlock

    def initializer(self, seed: int | None = None):
        """Llama's initializer (a function of seed and name); the stacked down projections `w2` are scaled
        by depth as Llama's `w2.weight` is."""
        llama_init = super().initializer(seed)

        def init(name: str, t: torch.Tensor) -> torch.Tensor:
            value = llama_init(name, t)
            return value / (2 * self.cfg.n_layers) ** 0.5 if name.endswith("experts.w2") else value

        return init

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        out = super().forward(tokens, targets, positions)
        if targets is None:
            return out
        return out + self.blocks_loss(self.layers)

    def blocks_loss(self, blocks) -> torch.Tensor:
        """The router losses of `blocks` in their last forward. The whole model adds every block's to its
        loss; a pipeline stage adds its own blocks' (spmd.pipeline.stage), so no stage drops them."""
        return sum(block.feed_forward.aux_loss for block in blocks)

    def router_stats(self) -> dict:
        """The last forward's router losses (summed over layers) and tokens per expert ([layers, experts])."""
        moes = [layer.feed_forward for layer in self.layers]
        return {
            "aux_loss": sum(m.aux_loss.detach() for m in moes),
            "tokens_per_expert": torch.stack([m.tokens_per_expert for m in moes]),
        }
