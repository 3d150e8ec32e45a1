"""Pipeline stages of a model without embed/block_inputs/head parts (a Hugging Face decoder, a nanoGPT): the
model's own forward, cut at block boundaries, so that spmd.parallelize lays each stage out as a whole model.

A stage is a shell of the model: the model's classes and parameter names, its own module objects outside
the block list (two stages on one rank share no hooks), and a block list holding only this stage's blocks
under their indices. It runs the model's forward. What the forward computes before the blocks (positions,
rotary tables, the causal mask) comes from the stage's input shape; on a stage after the first, the
modules with parameters there (the embedding) are stubs returning zeros of their output's shape, and the
first block's input is replaced by the hidden state received from the previous stage. A stage before the
last stops the forward after its last block and returns that block's hidden state.

Which stage holds a module outside the blocks follows from where the forward uses its parameters (one run
on meta tensors): before the blocks -> the first stage, after them -> the last, both (a head tied to the
embedding: GPT-2's `lm_head`, nanoGPT's `F.linear(x, wte.weight)`) -> both, and `sum_tied_grads` adds the
two stages' gradients over pp after backward.
"""

import copy
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..runtime.activations.moves import constrain
from ..runtime.experts.dispatch import balanced_routing
from .costs import default_example
from .shapes import StageBoundary, fake_inputs, fake_model
from .split import outside_blocks

__all__ = ["CutPlan", "trace_uses", "plan_cut", "cut_stage", "sum_tied_grads"]


@dataclass
class CutPlan:
    held: dict  # stage index -> names of the modules outside the blocks it holds
    tied: list = field(default_factory=list)  # parameter names held by the first and the last stage
    tie_ranks: tuple = ()  # pp ranks of those two stages


class _Uses(TorchFunctionMode):
    """Records the parameters torch functions receive before the first block and after the last."""

    def __init__(self):
        super().__init__()
        self.region, self.used = "before", {"before": set(), "after": set()}

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.region != "inside":
            self.used[self.region].update(id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, nn.Parameter))
        return func(*args, **kwargs)


def trace_uses(model: nn.Module, block_path: str, loss_fn=None) -> tuple[nn.Module, dict]:
    """Runs the stages' call, `model(tokens, targets)` (or `loss_fn(model(tokens), targets)`), on a fake copy
    and returns (the copy, {"before"|"after": ids of its parameters used before the first block / after the
    last}); raises ValueError, naming the problem, if that call fails or gives no scalar loss."""
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} adds a load-balancing loss over every layer's router logits at "
            f"once (config.output_router_logits), which pipeline stages holding some of the layers "
            f"cannot compute; set output_router_logits to false (config.json) or run without pp"
        )
    meta, mode = fake_model(model)
    blocks = meta.get_submodule(block_path)
    uses = _Uses()
    hooks = [
        blocks[0].register_forward_pre_hook(lambda m, a: setattr(uses, "region", "inside")),
        blocks[-1].register_forward_hook(lambda m, a, o: setattr(uses, "region", "after")),
    ]
    (tokens,) = default_example(model)
    tokens, targets = fake_inputs(mode, (tokens, tokens))
    try:
        with mode, uses, torch.no_grad(), balanced_routing(meta):
            _loss_of(meta(tokens, targets) if loss_fn is None else loss_fn(meta(tokens), targets))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001  (whatever the model's own code raises)
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: its forward failed on shapes "
            f"alone ({type(e).__name__}: {str(e)[:200]}). Stages call model(tokens, targets) and take "
            f"its loss; for another call pass loss_fn(model(tokens), targets)"
        ) from None
    finally:
        for h in hooks:
            h.remove()
    return meta, uses.used


def plan_cut(model: nn.Module, split, traced) -> CutPlan:
    """Which stage holds each module outside the blocks, from `trace_uses`'s (copy, uses)."""
    meta, used = traced
    blocks = meta.get_submodule(split.block_path)
    pre, post, _, _ = outside_blocks(meta, blocks)
    first, last = [], []
    for name in pre + post:
        ids = {id(p) for p in meta.get_submodule(name).parameters(recurse=False)}
        before, after = bool(ids & used["before"]), bool(ids & used["after"])
        if before or (not after and name in pre):
            first.append(name)
        if after or (not before and name in post):
            last.append(name)
    tied = sorted(
        f"{n}.{p}" for n in first if n in last for p, _ in meta.get_submodule(n).named_parameters(recurse=False)
    )
    ranks = (split.stages[0].rank, split.stages[-1].rank)
    if tied and ranks[0] == ranks[1]:
        raise ValueError(
            f"{type(model).__name__} uses {tied} both before and after its blocks (a tied head), and "
            f"this placement puts its first and last stage on one rank; use a schedule other than zbv"
        )
    held = {s.index: (first if s.first else []) + (last if s.last else []) for s in split.stages}
    return CutPlan(held, tied, ranks if tied else ())


def _shell(module: nn.Module) -> nn.Module:
    """A copy of `module` with its own dicts of children, parameters, buffers and hooks, the same tensors, and
    its instance methods (a replaced forward) bound to the copy."""
    new = copy.copy(module)
    for key, value in list(new.__dict__.items()):
        if key.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
        elif isinstance(value, types.MethodType) and value.__self__ is module:
            new.__dict__[key] = types.MethodType(value.__func__, new)
    return new


class _Absent(nn.Module):
    """Stands in for a module with parameters that a stage does not hold, which the forward runs before the
    blocks: zeros of an embedding's or a linear layer's output shape, else its input unchanged. The first
    block's input replaces what comes of them."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None):
        super().__init__()
        self.dtype = dtype or next(module.parameters()).dtype
        self.embedding = isinstance(module, nn.Embedding)
        self.width = getattr(module, "embedding_dim", None) or getattr(module, "out_features", None)

    def forward(self, x, *args, **kwargs):
        if self.width is None or not isinstance(x, torch.Tensor):
            return x
        like = x.unsqueeze(-1) if self.embedding else x[..., :1]
        return torch.zeros_like(like, dtype=self.dtype).expand(*like.shape[:-1], self.width)


def _stage_tree(module, prefix, split, blocks, held, outside, dtype):
    new = _shell(module)
    for name, child in module._modules.items():
        path = prefix + name
        if child is None:
            continue
        if path == split.block_path:
            new._modules[name] = nn.ModuleList()
            for i in blocks:  # under their model indices: the forward iterates them
                new._modules[name].add_module(str(i), child[i])
        elif path in outside and path not in held:
            new._modules[name] = _Absent(child, dtype)
        else:
            new._modules[name] = _stage_tree(child, path + ".", split, blocks, held, outside, dtype)
    return new


def _loss_of(out):
    """The model's output if a scalar, else its `loss` (ModelOutput, dict) or its first scalar (a tuple such as
    nanoGPT's (logits, loss))."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = next((t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0), None)
    if loss is None:
        raise ValueError(
            f"the model's output ({type(out).__name__}) holds no scalar loss for the last pipeline "
            f"stage; pass build_pipeline(loss_fn=fn(output, targets))"
        )
    return loss


def cut_stage(
    model: nn.Module,
    split,
    index: int,
    plan: CutPlan,
    hidden_axes,
    loss_fn=None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Stage `index` of `model` as a shell of it (module docstring); its forward is `(x, targets=None)` like a
    StageModule's: token ids on the first stage, the received hidden state on the others; the loss on the
    last, the hidden state as a local tensor on the others. `compute_dtype`: the dtype parameters compute in
    (spmd.parallelize's param_dtype), which the stubs' zeros take as the real modules' outputs would."""
    info = split.stages[index]
    all_blocks = model.get_submodule(split.block_path)
    pre, post, _, _ = outside_blocks(model, all_blocks)
    stage = _stage_tree(model, "", split, info.blocks, set(plan.held[index]), set(pre + post), compute_dtype)
    own = model.__dict__.get("forward")
    call = types.MethodType(own.__func__ if isinstance(own, types.MethodType) else type(model).forward, stage)
    box = {}
    if not info.first:
        all_blocks[info.blocks[0]].register_forward_pre_hook(
            lambda m, args, kwargs: (
                ((box["hidden"],) + tuple(args[1:]), kwargs)
                if args
                else (args, {**kwargs, "hidden_states": box["hidden"]})
            ),
            with_kwargs=True,
        )
    if not info.last:

        def stop(m, args, out):
            raise StageBoundary(out[0] if isinstance(out, (tuple, list)) else out)

        all_blocks[info.blocks[-1]].register_forward_hook(stop)

    def forward(x, targets=None):
        box["hidden"] = x
        tokens = x if info.first else torch.zeros_like(x[..., 0], dtype=torch.long)
        try:
            out = call(tokens, targets) if loss_fn is None else loss_fn(call(tokens), targets)
        except StageBoundary as boundary:
            h = constrain(boundary.hidden, *hidden_axes)
            # a fresh tensor, not a view of the DTensor's shard: zero-bubble schedules detach it in place
            return h.to_local().clone() if isinstance(h, DTensor) else h
        finally:
            box.clear()
        return _loss_of(out)

    stage.forward = forward
    return stage


def sum_tied_grads(params: dict, plan: CutPlan, group) -> None:
    """Adds the gradients of parameters held by both the first and the last stage (a tied head) over their two
    pp ranks, so both copies take the same optimizer step."""
    for name in plan.tied:
        p = params[name]
        if p.grad is None:  # both ranks take part, even where this step left no gradient
            p.grad = torch.zeros_like(p)
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
