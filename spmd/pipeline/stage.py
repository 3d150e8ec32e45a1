"""A pipeline stage as a module: a share of the model's blocks, plus the embedding on the first stage and the
head and loss on the last, keeping the model's parameter names (`layers.5.attention.wq.weight`).

A model opts in by writing its forward in three parts, as methods that use only the attributes they name:
`embed(tokens) -> h`, `block_inputs(h) -> tuple` (the extra arguments every block takes, e.g. RoPE tables)
and `head(h, targets=None) -> logits or loss` (`models/llama.py` does), and optionally
`blocks_loss(blocks) -> scalar`: loss terms its blocks add to the loss (a mixture of experts' router
losses, `models/moe.py`). Each stage adds its own blocks' terms: the last to the loss it returns, the
others into backward through their output (Megatron's aux-loss scaler: an identity whose backward also
seeds the terms with the loss's weight) while keeping their values for the step's reported loss.
The stage holds the modules those parts use under the same names, the model's own buffers, and its block
share; it runs the parts with itself in place of the model. So `spmd.parallelize` lays a stage out through the same
module hooks as a whole model: stage inputs arrive as plain local tensors (the root hook makes them DTensors with the
stage's `input_axes`), and a stage that is not the last returns its residual stream as a local tensor,
in the layout the next stage's `input_axes` assume.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.activations.moves import constrain

__all__ = ["PARTS", "StageModule", "LocalModel", "NamedParams", "has_parts", "has_blocks_loss"]

PARTS = ("embed", "block_inputs", "head")


def has_blocks_loss(model: nn.Module) -> bool:
    return callable(getattr(type(model), "blocks_loss", None))


class _AddToBackward(torch.autograd.Function):
    """Returns `h`; its backward also gives `loss` the gradient `weight`, as if `weight * loss` had been
    added to the loss that backward starts from."""

    @staticmethod
    def forward(ctx, h, loss, weight):
        ctx.seed = torch.ones_like(loss) * weight
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.seed, None


def has_parts(model: nn.Module) -> bool:
    return all(callable(getattr(type(model), p, None)) for p in PARTS)


def _attach(root: nn.Module, path: str, module: nn.Module):
    """Sets root.<path> = module, making plain containers for the dotted prefix."""
    *parents, leaf = path.split(".")
    for name in parents:
        if name not in root._modules:
            root.add_module(name, nn.Module())
        root = root._modules[name]
    root.add_module(leaf, module)


class StageModule(nn.Module):
    def __init__(self, model: nn.Module, split, index: int, hidden_axes=("batch", "seq", "embed"), loss_fn=None):
        super().__init__()
        info = split.stages[index]
        self.index, self.first, self.last = index, info.first, info.last
        self.hidden_axes = tuple(hidden_axes)
        self.block_indices = list(info.blocks)
        self.loss_weight = 1.0  # the weight of this micro-batch's loss in backward (the pipeline sets it)
        self.reported: list = []
        object.__setattr__(self, "_source", model)
        object.__setattr__(self, "_loss_fn", loss_fn)
        all_blocks = model.get_submodule(split.block_path)
        blocks = nn.ModuleList()
        for i in info.blocks:  # under their model indices, in a block list (spmd finds it: one bucket each)
            blocks.add_module(str(i), all_blocks[i])
        _attach(self, split.block_path, blocks)
        object.__setattr__(self, "_blocks", list(blocks))
        for name in (split.pre if self.first else []) + (split.post if self.last else []):
            _attach(self, name, model.get_submodule(name))
        for name, buf in model.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in model._non_persistent_buffers_set)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_source" not in self.__dict__:
                raise
        value = getattr(self.__dict__["_source"], name)
        if isinstance(value, torch.Tensor) or (
            isinstance(value, nn.Module)
            and (next(value.parameters(), None) is not None or next(value.buffers(), None) is not None)
        ):
            raise AttributeError(
                f"pipeline stage {self.index} (blocks {self.block_indices}) does not hold "
                f"{name!r}; a model part used it on a stage that does not own it"
            )
        return value

    def forward(self, x, targets=None, positions=None):
        cls = type(self.__dict__["_source"])
        h = cls.embed(self, x) if self.first else x
        extra = cls.block_inputs(self, h) if positions is None else cls.block_inputs(self, h, positions)
        for block in self.__dict__["_blocks"]:
            h = block(h, *extra)
        own = cls.blocks_loss(self, self.__dict__["_blocks"]) if has_blocks_loss(self.__dict__["_source"]) else None
        if not self.last:
            h = constrain(h, *self.hidden_axes)
            if own is not None:
                h = _AddToBackward.apply(h, own, self.loss_weight)
                value = own.detach()
                self.reported.append(value.full_tensor() if isinstance(value, DTensor) else value)
            # a fresh tensor, not a view of the DTensor's shard: zero-bubble schedules detach it in place
            return h.to_local().clone() if isinstance(h, DTensor) else h
        loss_fn = self.__dict__["_loss_fn"]
        loss = cls.head(self, h, targets) if loss_fn is None else loss_fn(cls.head(self, h), targets)
        return loss if own is None else loss + own

    def take_reported(self) -> torch.Tensor | None:
        """The sum of this stage's own loss terms over the micro-batches since the last call (a stage before
        the last; the last stage's are in the loss it returns), or None."""
        values, self.reported = self.reported, []
        return torch.stack(values).sum() if values else None


class LocalModel(nn.Module):
    """This rank's share of the model under the model's own names (the union of its stages), for the
    optimizer, checkpoints (`spmd.checkpoint.model_state`) and gradient clipping."""

    def __init__(self, model: nn.Module, split, indices):
        super().__init__()
        all_blocks = model.get_submodule(split.block_path)
        mine = sorted(i for s in indices for i in split.stages[s].blocks)
        _attach(self, split.block_path, nn.ModuleDict({str(i): all_blocks[i] for i in mine}))
        for s in indices:
            info = split.stages[s]
            for name in (split.pre if info.first else []) + (split.post if info.last else []):
                _attach(self, name, model.get_submodule(name))


class NamedParams(nn.Module):
    """Holds the given parameters under their qualified names (nested containers), for optimizers and
    checkpoints: named_parameters() gives the model's names."""

    def __init__(self, named):
        super().__init__()
        for name, p in named:
            *path, leaf = name.split(".")
            node = self
            for part in path:
                if part not in node._modules:
                    node.add_module(part, nn.Module())
                node = node._modules[part]
            node.register_parameter(leaf, p)
