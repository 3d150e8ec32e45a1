"""`spmd.OneBitAdam`: 1-bit Adam (Tang et al. 2021, DeepSpeed's OnebitAdam) on a model laid out by
spmd.parallelize over `dp`, `fsdp` or both (or a plain model in one process).

Steps 1..warmup are exact AdamW on reduced gradients (the model reduces them as usual; momentum and variance
live in the parameter's storage layout). From step warmup+1 the variance v is frozen and, on N workers
(every rank of the mesh: each sees its own slice of the batch),

    m_i <- b1*m + (1-b1)*g_i                   g_i: worker i's LOCAL gradient, never reduced
    m   <- compressed average of the m_i       spmd.optim.onebit_wire: signs + one scale per chunk,
                                               error feedback on the worker and on the server
    w   <- w*(1 - lr*wd) - lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^warmup)) + eps)

so after warm-up each step moves ~1/32 of an fp32 all-reduce. The model's own gradient reduction is
switched off for those steps with spmd.no_sync: a forward pre-hook enters it from the forward after the last
warm-up step on (backward then leaves each gradient as this rank's partial sum, p.grad Partial over the
data axes; the worker's gradient is that times the number of ranks it is partial over).

Every worker needs the whole averaged momentum for its next local momentum, so the momentum is whole on
every rank after warm-up (gathered once, at the first compressed step) and the worker error is
parameter-sized; the frozen variance stays in the storage layout. Server chunks are equal slices of the
flattened parameter (rank r serves slice r): under fsdp a rank's stored shard is a box of the matrix (dim 1
of most weights under the default rules), not a contiguous range of it, and the all-gather brings every
chunk to every rank anyway; each rank then updates its stored shard with its box of the averaged momentum.

State per parameter (in spmd.checkpoint by parameter name): `step`, `exp_avg`, `exp_avg_sq` (frozen after
warm-up), `worker_error` [N, padded numel] and `server_error` [N, padded numel / N], one row per rank.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..layout.mesh import mesh_sizes
from ..runtime import tags
from ..runtime.gradients.layouts import grads_layout, optim_layout
from ..runtime.parallelize import no_sync
from ..runtime.state import STATE_ATTR
from .onebit_wire import exchange, padded_numel

__all__ = ["OneBitAdam", "DATA_AXES"]

DATA_AXES = ("dp", "fsdp")  # the mesh axes whose ranks are 1-bit Adam's workers


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam on `model`'s parameters (see the module docstring): weight decay `weight_decay` on the
    parameters of 2 or more dims, none on the others; `warmup` (>= 1) exact AdamW steps before compression."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup: int = 100,
    ):
        if not (lr > 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1 and eps >= 0 and warmup >= 1):
            raise ValueError(
                f"OneBitAdam needs lr > 0, 0 <= betas < 1, eps >= 0 and warmup >= 1 (the frozen variance "
                f"comes from the warm-up); got lr={lr}, betas={betas}, eps={eps}, warmup={warmup}"
            )
        self.mesh = _check_layout(model)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
            dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0),
        ]
        super().__init__([g for g in groups if g["params"]], dict(lr=lr, betas=betas, eps=eps))
        self.warmup = warmup
        self.world = self.mesh.size() if self.mesh is not None else 1
        self._unreduced = no_sync(model) if self.mesh is not None else None
        self._holding = False
        model.register_forward_pre_hook(self._before_forward)

    def steps_done(self) -> int:
        """Steps taken so far (read from the state, so it holds after a checkpoint is loaded into it)."""
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state[p]:
                    return int(self.state[p]["step"].item())
        return 0

    def compressing(self) -> bool:
        """Whether the next step is a compressed one (its backward must leave gradients unreduced)."""
        return self.steps_done() >= self.warmup

    def _before_forward(self, module, args):
        if self._unreduced is None:
            return
        if self.compressing():
            self._unreduced.__enter__()  # held until the step: the next forward enters it again
            self._holding = True
        elif self._holding:  # an earlier checkpoint loaded: back to reduced gradients
            self._unreduced.__exit__(None, None, None)
            self._holding = False

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates every parameter's state now, as the first step would (for loading a checkpoint into it)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state_of(p)

    def _state_of(self, p) -> dict:
        state = self.state[p]
        if not state:
            n = padded_numel(p.numel(), self.world)
            like = _local(p)
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["worker_error"] = self._per_rank(like.new_zeros(1, n, dtype=torch.float32))
            state["server_error"] = self._per_rank(like.new_zeros(1, n // self.world, dtype=torch.float32))
        return state

    def _per_rank(self, row: torch.Tensor):
        """A tensor of one row per rank (row r on rank r): a DTensor sharding dim 0 over every mesh dim."""
        if self.mesh is None:
            return row
        return DTensor.from_local(row, self.mesh, [Shard(0)] * self.mesh.ndim, run_check=False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not pairs:
            return loss
        for p, _ in pairs:
            self._state_of(p)
        if self.compressing():
            self._compressed_step(pairs)
        else:
            for p, group in pairs:
                self._adam_step(p, group)
        return loss

    def _adam_step(self, p, group) -> None:
        """Exact AdamW (torch's formulas) on this rank's shard of the reduced gradient."""
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
            raise RuntimeError(
                f"OneBitAdam's warm-up step needs reduced gradients, but {_name(p)}'s is "
                f"{p.grad.placements}; the last backward before a warm-up step must run outside spmd.no_sync"
            )
        state, (b1, b2), lr = self.state[p], group["betas"], group["lr"]
        state["step"] += 1
        t = state["step"].item()
        g, m, v, w = _local(p.grad).float(), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(p)
        w.mul_(1 - lr * group["weight_decay"])
        m.mul_(b1).add_((1 - b1) * g)
        v.mul_(b2).add_((1 - b2) * g * g)
        w.sub_(lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"]))

    def _compressed_step(self, pairs) -> None:
        vectors, worker_errors, server_errors = [], [], []
        for p, group in pairs:
            state, b1 = self.state[p], group["betas"][0]
            m = self._whole_momentum(p, state)
            m.mul_(b1).add_((1 - b1) * self._worker_gradient(p))
            flat = m.new_zeros(padded_numel(m.numel(), self.world))
            flat[: m.numel()] = m.reshape(-1)
            vectors.append(flat)
            worker_errors.append(_local(state["worker_error"])[0])
            server_errors.append(_local(state["server_error"])[0])
        with tags.phase("optimizer"), tags.reason("optimizer", "1-bit Adam: compressed momentum all-reduce"):
            averaged = exchange(vectors, worker_errors, server_errors, self.world)
        for (p, group), avg in zip(pairs, averaged):
            state, (b1, b2), lr = self.state[p], group["betas"], group["lr"]
            state["step"] += 1
            t = state["step"].item()
            m = _local(state["exp_avg"])
            m.copy_(avg[: m.numel()].view_as(m))
            w, v = _local(p), _local(state["exp_avg_sq"])
            w.mul_(1 - lr * group["weight_decay"])
            w.sub_(lr * (_box_of(m, p) / (1 - b1**t)) / ((v / (1 - b2**self.warmup)).sqrt() + group["eps"]))

    def _whole_momentum(self, p, state) -> torch.Tensor:
        """The momentum's whole local tensor: gathered from the storage layout at the first compressed step."""
        m = state["exp_avg"]
        if isinstance(m, DTensor) and any(not pl.is_replicate() for pl in m.placements):
            with tags.phase("optimizer"), tags.reason("optimizer", f"1-bit Adam: gather {_name(p)}'s momentum once"):
                m = state["exp_avg"] = m.redistribute(m.device_mesh, [Replicate()] * m.device_mesh.ndim)
        return _local(m)

    def _worker_gradient(self, p) -> torch.Tensor:
        """This worker's gradient g_i (fp32, whole): the partial sum backward left times the number of ranks
        it is partial over, so that the mean over the workers is the gradient of the global batch."""
        g = p.grad
        if not isinstance(g, DTensor):
            return g.float()
        if any(pl.is_shard() for pl in g.placements):
            raise RuntimeError(
                f"{_name(p)}'s gradient was reduced ({g.placements}) before a compressed OneBitAdam step; "
                f"run the forward after building the optimizer (its forward hook keeps gradients unreduced) "
                f"and do not call spmd.reduce_gradients or clip them with torch (use opt.clip_grad_norm_)"
            )
        parts = math.prod(g.device_mesh.size(d) for d, pl in enumerate(g.placements) if pl.is_partial())
        return _local(g).float() * parts

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips the gradients the next step takes and returns their norm. Warm-up: torch's global norm of the
        reduced gradients. Compressed steps: sqrt(mean_i ||g_i||^2) over the workers' local gradients (one
        float all-reduced; an upper bound of the averaged gradient's norm), every worker scaled alike."""
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not self.compressing():
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None)
        squares = sum((self._worker_gradient(p).pow(2).sum() for p in params), torch.zeros(()))
        if self.world > 1:
            with tags.phase("optimizer"), tags.reason("optimizer", "1-bit Adam: norm of the local gradients"):
                dist.all_reduce(squares)
        norm = (squares / self.world).sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            _local(p.grad).mul_(scale.to(_local(p.grad).device))
        return norm


def _check_layout(model: nn.Module):
    """The model's mesh (None for a plain model), or a ValueError naming what 1-bit Adam cannot run on."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError(
                "OneBitAdam needs the model laid out by spmd.parallelize itself (a pipeline's stages each "
                "hold their own mesh: pp is not supported), or a plain model"
            )
        return None
    other = {a: n for a, n in mesh_sizes(state.mesh).items() if n > 1 and a not in DATA_AXES}
    if other:
        raise ValueError(
            f"OneBitAdam compresses the momentum across data-parallel workers (mesh axes {'/'.join(DATA_AXES)}); "
            f"this mesh also has {', '.join(f'{a}={n}' for a, n in other.items())}: use a mesh of dp and "
            f"fsdp only, or AdamW"
        )
    if state.offload is not None or state.master != "params":
        raise ValueError(
            f"OneBitAdam steps on the device on the parameters themselves; offload={state.offload!r}, "
            f"master={state.master!r} are not supported: leave offload out and keep master='params'"
        )
    for name, p in model.named_parameters():
        if grads_layout(p) != tuple(p.placements) or optim_layout(p) != tuple(p.placements):
            raise ValueError(
                f"OneBitAdam keeps its state in the parameters' storage layout, but the rules shard {name}'s "
                f"gradient or optimizer state further (ZeRO 1/2): use Rules.default(zero=3)"
            )
    ranks = state.mesh.mesh.flatten().tolist()
    if dist.is_initialized() and ranks != list(range(dist.get_world_size())):
        raise ValueError(
            f"OneBitAdam exchanges over every process in rank order; this mesh holds ranks {ranks} of "
            f"{dist.get_world_size()}: lay the model out on a mesh of every process (spmd.make_mesh)"
        )
    return state.mesh


def _box_of(whole: torch.Tensor, p) -> torch.Tensor:
    """The part of `whole` (p's global shape) that p's local shard holds (a view)."""
    if not isinstance(p, DTensor):
        return whole
    lengths, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    for d, (n, at) in enumerate(zip(lengths, offsets)):
        whole = whole.narrow(d, at, n)
    return whole


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _name(p) -> str:
    return getattr(p, "_spmd_name", f"a parameter of shape {tuple(p.shape)}")
