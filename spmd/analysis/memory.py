"""Memory per rank of a laid-out model: parameters, gradients and optimizer states from the local shards, and
the activations: the storages autograd keeps for backward that are not the model's own.

Each state is counted in its own layout (spmd.Rules: params, grads and optimizer maps) and dtype: parameters
as stored; gradients in the parameters' dtype (autograd holds them so); optimizer states in the master's
dtype, plus the fp32 master copy itself when `master="optimizer"` keeps one beside lower-precision parameters
(the ZeRO paper's K = 12 for Adam: 4 master + 4 + 4 moments). `peak_bytes` adds what is live on top of
those at the moment a step's live tensor bytes peak, and the model's buffers. `wire_buffer_bytes`: what a
quantized wire (spmd.parallelize's `comm`) adds, the packed send and receive buffers of its largest collective.
"""

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..layout.annotate import get_axes
from ..optim.muon import muon_param_groups
from ..runtime.dtensor.wrap import local_of
from ..runtime.experts.dispatch import EXPERTS
from ..runtime.parameters.reshard import storage_key
from ..runtime.state import STATE_ATTR
from ..runtime.wire.flat import ON_THE_WIRE

__all__ = [
    "activation_bytes",
    "local_bytes",
    "memory_per_rank",
    "peak_bytes",
    "unreduced_bytes",
    "wire_buffer_bytes",
    "OPTIMIZER_STATES",
]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "muon": 2}  # states per parameter element
MUON_MATRIX_STATES = 1  # spmd.Muon's momentum on its matrices (AdamW's two on the rest)


def activation_bytes(saved: dict, model: nn.Module) -> int:
    """Bytes of the storages autograd saved ({storage: bytes}, see runtime.reshard.observe_saved), less the
    model's own parameters and buffers: a weight or a RoPE table that autograd saves is held anyway (counted
    under parameters), so it costs no activation memory."""
    own = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    return sum(n for key, n in saved.items() if key not in own)


def unreduced_bytes(model: nn.Module, state) -> tuple[int, int]:
    """(every gradient as backward produces it, the part of those the gradient reducer copies when it cuts
    them into per-rank chunks): bytes per rank, each parameter's compute layout in the reduce dtype. A chunk
    is a copy when the gradient is reduce-scattered along a dim with a local dim of size > 1 before it (a
    column shard of a matrix); along the outermost dim it is a view."""
    total = copied = 0
    for p in {id(p): p for p in model.parameters()}.values():
        size = state.reduce_dtype.itemsize if state is not None and state.reduce_dtype is not None else p.element_size()
        n = _numel(p, "_spmd_compute") * size
        total += n
        if isinstance(p, DTensor) and hasattr(p, "_spmd_compute"):
            local, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p._spmd_compute)
            stored = getattr(p, "_spmd_grads", None) or p.placements
            dims = {s.dim for s, c in zip(stored, p._spmd_compute) if s.is_shard() and not c.is_shard()}
            copied += n if any(math.prod(local[:d]) > 1 for d in dims) else 0
    return total, copied


def peak_bytes(memory: dict, unreduced: int, chunk_copies: int, buffers: int) -> int:
    """The most tensor bytes a rank holds in one step (forward, backward, optimizer step). Measured on the tiny
    Llama (fp32; fsdp=4, fsdp=2,tp=2,sp, dp=2,fsdp=2), it falls at the end of backward, as the gradient
    reducer packs its reduce-scatter buffer; live then:
    - what lives between steps: parameters, optimizer states (`memory`) and the model's buffers (`buffers`);
    - every gradient in its compute layout twice (`unreduced`): autograd's per-parameter gradients, and the
      reducer's flat buffer they are packed into;
    - the copies of the chunks that are not views (`chunk_copies`, see `unreduced_bytes`) while they are packed,
      then, once they are freed, the reduce-scatter's output: the reduced gradient shards (`memory["gradients"]`).
    Left out: activations and gathered buckets (all freed by then: backward has finished), a model whose
    gradients span several reducer buffers (they are reduced while backward runs, so its peak is earlier and
    holds activations), AdamW's per-tensor step counts, scratch freed inside one op, and offloaded states
    (explain gives no peak under `offload`)."""
    between_steps = memory["parameters"] + memory["optimizer"] + buffers
    return between_steps + 2 * unreduced + max(chunk_copies, memory["gradients"])


def local_bytes(t) -> int:
    local = local_of(t)
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
    offload = (
        None
        if state is None or state.offload is None
        else "nvme"
        if state.offload.startswith("nvme:")
        else state.offload
    )
    muon = {id(p) for p in muon_param_groups(model)[0]} if optimizer == "muon" else set()
    params = grads = 0
    opt, grads_host = [], []  # per parameter
    for p in {id(p): p for p in model.parameters()}.values():
        params += local_bytes(p)
        grads += _numel(p, "_spmd_grads") * p.element_size()
        separate = copies and p.dtype != torch.float32 and p.dtype.is_floating_point
        master_size = 4 if separate else p.element_size()
        states = MUON_MATRIX_STATES if id(p) in muon else OPTIMIZER_STATES[optimizer]
        opt.append(_numel(p, "_spmd_optim") * master_size * (states + (separate or offload in ("optimizer", "nvme"))))
        grads_host.append(_numel(p, "_spmd_optim") * master_size)
    mem = {
        "parameters": params,
        "gradients": grads,
        "optimizer": 0 if offload else sum(opt),
        "activations": activations,
    }
    mem["total"] = sum(mem.values())
    if offload == "optimizer":
        mem.update({"gradients_host": sum(grads_host), "optimizer_host": sum(opt)})
    elif offload == "params":  # every state on the host; the device holds a parameter only while in use
        mem.update(
            {
                "parameters": 0,
                "gradients": 0,
                "total": activations,
                "parameters_host": params,
                "gradients_host": grads,
                "optimizer_host": sum(opt),
            }
        )
    elif offload == "nvme":  # the files hold it all; the step brings one parameter's state in at a time
        mem.update(
            {
                "optimizer_nvme": sum(opt),
                "optimizer_host": max(opt, default=0),
                "gradients_host": max(grads_host, default=0),
            }
        )
    experts = sum(local_bytes(p) for p in model.parameters() if EXPERTS in (get_axes(p) or ()))
    if experts:  # part of `parameters`: the stacked experts this rank holds (E/ep of them under ep)
        mem["expert_parameters"] = experts
    return mem


def _numel(p, layout_attr: str) -> int:
    """Elements of p's local shard in the layout `layout_attr` names (its storage layout when it has none)."""
    layout = getattr(p, layout_attr, None)
    if not isinstance(p, DTensor) or layout is None:
        local = local_of(p)
        return local.numel()
    shape, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, layout)
    return math.prod(shape)


def wire_buffer_bytes(records, sizes: dict) -> int:
    """The most bytes one quantized collective's packed codes and scales hold on a rank at once: an
    all-gather's send row and the n rows it receives, an all-to-all's n rows sent and n received."""
    most = 0
    for c in records:
        if ON_THE_WIRE not in c.reason:
            continue
        n = math.prod(sizes[a] for a in c.axes)
        rows = c.bytes * n // (n - 1)  # the ring convention's bytes, back to every row
        most = max(most, rows + (rows // n if c.kind == "all_gather" else rows))
    return most
