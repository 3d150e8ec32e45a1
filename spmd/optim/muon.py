"""`spmd.Muon`: Muon (Keller Jordan, 2024) for the model's hidden matrices, AdamW for everything else, on
parameters laid out by spmd.parallelize (DTensors in their storage layout, sharded by fsdp and tp) or on
plain tensors.

Muon, per 2-D matrix W with gradient G:

    B <- beta*B + (1-beta)*G                      momentum, kept in the parameter's (optimizer map's) layout
    U <- (1-beta)*G + beta*B  (Nesterov)  or  B
    O <- NewtonSchulz5(U)                         quintic, (a,b,c) = (3.4445, -4.7750, 2.0315), 5 steps
    W <- W*(1 - lr*wd) - lr * max(1, rows/cols)**0.5 * O

The momentum update is elementwise and runs on each rank's shard. Newton-Schulz needs the whole U: each
matrix is gathered whole to one rank (spmd.optim.whole_matrix), orthogonalised there and its shards sent
back: ~2x the matrix's bytes per step, spread evenly. Orthogonalising the local shards instead would be a
different (wrong) update. Newton-Schulz runs in bf16 on CUDA (as published) and in fp32 elsewhere
(`ns_dtype` overrides). The scale `max(1, rows/cols)**0.5` is the published one, so Muon's lr is its own
(0.02 typical), not AdamW's.

Embeddings and the LM head (a dim named `vocab`, or an nn.Embedding), norms, biases and scalars step with
AdamW (`muon_param_groups`); AdamW's weight decay applies to its 2-D weights only, as the trainer's does.
"""

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..layout.annotate import get_axes
from .whole_matrix import WholeMatrixPlan

__all__ = ["Muon", "muon_param_groups", "newton_schulz", "NS_COEFFICIENTS"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `g`, approximately (the quintic iteration of Muon)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype or (torch.bfloat16 if g.is_cuda else torch.float32))
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a_ = x @ x.mT
        x = a * x + (b * a_ + c * a_ @ a_) @ x
    return (x.mT if tall else x).to(g.dtype)


def muon_param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's): Muon takes the 2-D weights except embeddings and the head (a dim named
    `vocab` by spmd.annotate, or an nn.Embedding's weight); AdamW takes those and every non-2-D parameter."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon, adamw, seen = [], [], set()
    for _, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        whole = p.dim() == 2 and id(p) not in embedding and "vocab" not in (get_axes(p) or ())
        (muon if whole else adamw).append(p)
    return muon, adamw


class Muon(torch.optim.Optimizer):
    """Muon on `model`'s hidden matrices, AdamW on the rest (see the module docstring). Groups carry
    `use_muon`; AdamW's state is `exp_avg`, `exp_avg_sq`, `step`, Muon's `momentum_buffer`, each in its
    parameter's layout, so spmd.checkpoint saves them by parameter name and loads them onto any mesh.
    Works under spmd.shard_optimizer (ZeRO-1/2): it then steps on the masters in the optimizer map's layout."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        ns_dtype: torch.dtype | None = None,
    ):
        if not (lr > 0 and adamw_lr > 0 and 0 <= momentum < 1 and ns_steps >= 1):
            raise ValueError(
                f"Muon needs lr > 0, adamw_lr > 0, 0 <= momentum < 1 and ns_steps >= 1; got lr={lr}, "
                f"adamw_lr={adamw_lr}, momentum={momentum}, ns_steps={ns_steps}"
            )
        muon, adamw = muon_param_groups(model)
        groups = [
            dict(
                params=muon,
                use_muon=True,
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                weight_decay=weight_decay,
            ),
            dict(
                params=[p for p in adamw if p.dim() >= 2],
                use_muon=False,
                lr=adamw_lr,
                betas=adamw_betas,
                eps=adamw_eps,
                weight_decay=adamw_weight_decay,
            ),
            dict(
                params=[p for p in adamw if p.dim() < 2],
                use_muon=False,
                lr=adamw_lr,
                betas=adamw_betas,
                eps=adamw_eps,
                weight_decay=0.0,
            ),
        ]
        super().__init__([g for g in groups if g["params"]], dict(lr=lr))
        self.ns_dtype = ns_dtype
        self._plans = {}

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates every parameter's state now, as the first step would (for loading a checkpoint into it)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state_of(p, group)

    def _state_of(self, p, group) -> dict:
        state = self.state[p]
        if not state:
            if group["use_muon"]:
                state["momentum_buffer"] = torch.zeros_like(p)
            else:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon_step if group["use_muon"] else self._adamw_step)(params, group)
        return loss

    def _muon_step(self, params, group) -> None:
        beta, updates = group["momentum"], []
        for p in params:
            buf, g = _local(self._state_of(p, group)["momentum_buffer"]), _local(p.grad)
            buf.lerp_(g, 1 - beta)
            updates.append(g.lerp(buf, beta) if group["nesterov"] else buf.clone())
        dtype = self.ns_dtype

        def orthogonalise(whole, m):
            return newton_schulz(whole, group["ns_steps"], dtype) * max(1.0, whole.size(0) / whole.size(1)) ** 0.5

        if isinstance(params[0], DTensor):
            updates = self._plan(params).apply(updates, orthogonalise)
        else:
            updates = [orthogonalise(u, m) for m, u in enumerate(updates)]
        for p, u in zip(params, updates):
            w = _local(p)
            w.mul_(1 - group["lr"] * group["weight_decay"])
            w.add_(u, alpha=-group["lr"])

    def _plan(self, params) -> WholeMatrixPlan:
        key = tuple(id(p) for p in params)
        if key not in self._plans:
            if not all(isinstance(p, DTensor) for p in params):
                raise ValueError(
                    "Muon got DTensor and plain parameters in one group; lay the whole model out "
                    "with spmd.parallelize before building the optimizer"
                )
            self._plans = {key: WholeMatrixPlan.of(params)}
        return self._plans[key]

    def _adamw_step(self, params, group) -> None:
        (b1, b2), eps, lr = group["betas"], group["eps"], group["lr"]
        for p in params:
            state = self._state_of(p, group)
            state["step"] += 1
            t = state["step"].item()
            g, m, v, w = _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(p)
            w.mul_(1 - lr * group["weight_decay"])
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own elements (a DTensor's local shard, sharing its storage)."""
    return t.to_local() if isinstance(t, DTensor) else t
