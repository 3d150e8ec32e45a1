"""Forwards on shapes alone, for planning stages: a copy of the model on fake tensors (no data; a model that
branches on values, as transformers' mask helpers do, takes the path it takes under tracing), and the
hidden state its first block receives, which is what stages pass on."""

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..layout.annotate import fake_copy

__all__ = ["fake_model", "fake_inputs", "hidden_of", "StageBoundary", "hidden_arg"]


class StageBoundary(Exception):
    """Raised at a stage boundary to stop a model's forward, carrying the hidden state there."""

    def __init__(self, hidden):
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


def hidden_arg(args, kwargs):
    """A block's hidden-state input: its first argument, or `hidden_states=`."""
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise ValueError(
        "a block takes its hidden state neither as its first argument nor as hidden_states=...; "
        "its model cannot be cut into pipeline stages"
    )


def fake_model(model: nn.Module) -> tuple[nn.Module, FakeTensorMode]:
    """(a copy of `model` on fake CPU tensors, the FakeTensorMode to run it under)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return fake_copy(model, mode), mode


def fake_inputs(mode: FakeTensorMode, inputs) -> tuple:
    """`inputs` (real or meta tensors, or other values) as fake tensors of the same shapes and dtypes."""
    with mode:
        return tuple(torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in inputs)


def hidden_of(model: nn.Module, mode: FakeTensorMode, block_path: str, tokens: torch.Tensor) -> torch.Tensor:
    """The input of the first block of `model` (a fake_model copy) for `tokens`: shape and dtype only."""

    def stop(m, args, kwargs):
        raise StageBoundary(hidden_arg(args, kwargs))

    hook = model.get_submodule(block_path)[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with mode, torch.no_grad():
            model(*fake_inputs(mode, (tokens,)))
    except StageBoundary as boundary:
        return boundary.hidden
    finally:
        hook.remove()
    raise ValueError(f"the forward of {type(model).__name__} never ran its first block")
