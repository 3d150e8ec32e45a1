"""Memory per rank of a laid-out model: parameters, gradients and optimizer states from the local shards, and
the activations: the storages autograd keeps for backward that are not the model's own.

Each state is counted in its own layout (spmd.Rules: params, grads and optimizer maps) and dtype: parameters
as stored; gradients in the parameters' dtype (autograd holds them so); optimizer states in the master's
dtype, plus the fp32 master copy itself when `master="optimizer"` keeps one beside lower-precision parameters
(the ZeRO paper's K = 12 for Adam: 4 master + 4 + 4 moments). `peak_bytes` adds what is live on top of
those at the moment a step's live tensor bytes peak.
"""
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..layout.annotate import get_axes
from ..runtime.experts import EXPERTS
from ..runtime.reshard import storage_key
from ..runtime.state import STATE_ATTR

__all__ = ["activation_bytes", "gathered_bytes", "largest_activation", "local_bytes", "memory_per_rank", "peak_bytes",
           "unreduced_bytes", "OPTIMIZER_STATES"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # states per parameter element


def activation_bytes(saved: dict, model: nn.Module) -> int:
    """Bytes of the storages autograd saved ({storage: bytes}, see runtime.reshard.observe_saved), less the
    model's own parameters and buffers: a weight or a RoPE table that autograd saves is held anyway (counted
    under parameters), so it costs no activation memory."""
    own = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    return sum(n for key, n in saved.items() if key not in own)


def largest_activation(saved: dict, model: nn.Module) -> int:
    """Bytes of the largest storage autograd saved that is not the model's own: a language model's logits (or
    their log-softmax), whose gradient of the same size backward makes."""
    own = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    return max((n for key, n in saved.items() if key not in own), default=0)


def unreduced_bytes(model: nn.Module, state) -> int:
    """Bytes per rank of every gradient as backward produces it: each parameter's compute layout, in the
    reduce dtype (what the gradient reducer packs before its collectives)."""
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        size = state.reduce_dtype.itemsize if state is not None and state.reduce_dtype is not None else p.element_size()
        total += _numel(p, "_spmd_compute") * size
    return total


def gathered_bytes(state) -> tuple[int, int]:
    """(the root unit's gathered parameters, the largest block's gathered bucket), bytes per rank in the
    compute layout and dtype: the first is kept from forward to backward, the second lives while its block runs
    (and, prefetched, while the block next to it runs)."""
    if state is None:
        return 0, 0
    size = state.param_dtype.itemsize if state.param_dtype is not None else None
    root, blocks = 0, [0]
    for bucket in state.buckets.values():
        n = sum(_numel(p, "_spmd_compute") * (size or p.element_size()) for p in bucket.params)
        if bucket.keep:
            root = n
        else:
            blocks.append(n)
    return root, max(blocks)


def peak_bytes(memory: dict, unreduced: int, root_gathered: int, block_gathered: int, logits: int) -> int:
    """The most tensor bytes a rank holds in one step (forward, backward, optimizer step), at the moment it
    happens: the end of backward, while the gradient reducer's reduce-scatter runs (measured on the tiny Llama
    under fsdp, fsdp+tp+sp and dp+fsdp; forward's end and the AdamW step stay below it). Live then:
    - the parameters and optimizer states (`memory`), and the reduced gradient shards (`gradients`);
    - the gradients in their compute layout twice (`unreduced`): the reducer's flat buffer and as many bytes of
      per-parameter gradients and their pieces, not yet freed by the engine;
    - the root unit's gathered parameters, kept from forward (`root_gathered`), and one block's gathered bucket
      (`block_gathered`: the last regathered block's, still held by the graph);
    - the logits' gradient (`logits`: the size of the largest activation).
    Left out: the activations (freed by then), a second prefetched bucket (none is in flight at the end of
    backward), AdamW's per-tensor step counts, and scratch a kernel or collective frees inside one op."""
    held = memory["parameters"] + memory["optimizer"] + memory["gradients"]
    return held + 2 * unreduced + root_gathered + block_gathered + logits


def local_bytes(t) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def memory_per_rank(model: nn.Module, optimizer: str, activations: int = 0, state=None) -> dict:
    """Bytes per rank of parameters, gradients and optimizer states, from the local shards of each state's layout.
    Offloaded (`offload="optimizer"`): `optimizer_host` holds the masters and states, `gradients_host` the
    gradient shards copied out for the step, and `optimizer` on the device is 0; under "nvme:DIR" the masters
    and states are `optimizer_nvme` (files) and the step streams them through host memory one parameter at a
    time: `optimizer_host` and `gradients_host` are then the largest parameter's. Under "params" the parameter
    shards and their gradients are `parameters_host` and `gradients_host` too. `total` is the device's.
    `state`: the layout's SPMDState where `model` holds none itself (a pipeline rank's stages)."""
    state = state or getattr(model, STATE_ATTR, None)
    copies = state is not None and state.master == "optimizer"
    offload = None if state is None or state.offload is None else "nvme" if state.offload.startswith("nvme:") \
        else state.offload
    states = OPTIMIZER_STATES[optimizer]
    params = grads = 0
    opt, grads_host = [], []  # per parameter
    for p in {id(p): p for p in model.parameters()}.values():
        params += local_bytes(p)
        grads += _numel(p, "_spmd_grads") * p.element_size()
        separate = copies and p.dtype != torch.float32 and p.dtype.is_floating_point
        master_size = 4 if separate else p.element_size()
        opt.append(_numel(p, "_spmd_optim") * master_size * (states + (separate or offload in ("optimizer", "nvme"))))
        grads_host.append(_numel(p, "_spmd_optim") * master_size)
    mem = {"parameters": params, "gradients": grads, "optimizer": 0 if offload else sum(opt),
           "activations": activations}
    mem["total"] = sum(mem.values())
    if offload == "optimizer":
        mem.update({"gradients_host": sum(grads_host), "optimizer_host": sum(opt)})
    elif offload == "params":  # every state on the host; the device holds a parameter only while in use
        mem.update({"parameters": 0, "gradients": 0, "total": activations, "parameters_host": params,
                    "gradients_host": grads, "optimizer_host": sum(opt)})
    elif offload == "nvme":  # the files hold it all; the step brings one parameter's state in at a time
        mem.update({"optimizer_nvme": sum(opt), "optimizer_host": max(opt, default=0),
                    "gradients_host": max(grads_host, default=0)})
    experts = sum(local_bytes(p) for p in model.parameters() if EXPERTS in (get_axes(p) or ()))
    if experts:  # part of `parameters`: the stacked experts this rank holds (E/ep of them under ep)
        mem["expert_parameters"] = experts
    return mem


def _numel(p, layout_attr: str) -> int:
    """Elements of p's local shard in the layout `layout_attr` names (its storage layout when it has none)."""
    layout = getattr(p, layout_attr, None)
    if not isinstance(p, DTensor) or layout is None:
        local = p._local_tensor if isinstance(p, DTensor) else p
        return local.numel()
    shape, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, layout)
    return math.prod(shape)
