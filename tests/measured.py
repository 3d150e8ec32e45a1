"""Memory measured on real tensors, to hold `spmd.explain`'s plan.memory against.

`state_bytes(model, opt)`: bytes this rank holds of parameters, gradients and AdamW's two moments, read off
the local shards after a real step. `saved_bytes()`: the storages autograd keeps for backward while the
context is open, counted where they are kept. The count wraps every saved-tensor hook as it is installed
(spmd's ZeRO-3 hooks, torch's checkpoint hooks, and an outermost one of its own), and counts what each
pack hook returns: a tensor is kept, a handle (a regather, a checkpoint's recompute holder) is not. Those
kept while an attention call runs (spmd.runtime.activations.attention_memory scopes each one) are attention's part.
"""

import contextlib

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from spmd.runtime.activations import attention_memory


def _local(t: torch.Tensor) -> torch.Tensor:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.elem if isinstance(local, AsyncCollectiveTensor) else local


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    return {
        "parameters": sum(_nbytes(p) for p in params),
        "gradients": sum(_nbytes(p.grad) for p in params),
        "optimizer": sum(_nbytes(opt.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")),
    }


@contextlib.contextmanager
def saved_bytes(model: torch.nn.Module):
    """Yields a dict that ends up holding {"activations": bytes, "attention": bytes}: the storages kept for
    backward, each once, less the model's own parameters and buffers (a saved weight or RoPE table costs no
    extra memory), and those of them that attention kept."""
    kept: dict[int, int] = {}
    by_attention: set[int] = set()

    def keep(x):
        if isinstance(x, torch.Tensor):
            storage = _local(x).untyped_storage()
            kept[storage._cdata] = storage.nbytes()
            if attention_memory.attending_now():
                by_attention.add(storage._cdata)
        return x

    hooks = torch.autograd.graph.saved_tensors_hooks
    original = hooks.__init__

    def counting(self, pack_hook, unpack_hook):
        original(self, lambda t: keep(pack_hook(t)), unpack_hook)

    result = {}
    hooks.__init__ = counting
    try:
        with hooks(lambda t: t, lambda t: t), attention_memory.observe({}):  # scopes attention calls
            yield result
    finally:
        hooks.__init__ = original
    own = {_local(t).untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
    result["activations"] = sum(n for key, n in kept.items() if key not in own)
    result["attention"] = sum(n for key, n in kept.items() if key in by_attention and key not in own)
