"""`compile_blocks(model)`: torch.compile each repeated block of a (parallelized) model.

A block that runs on local tensors (data-only layouts, spmd.runtime.local.blocks) compiles its forward alone, as a
plain model's block would compile: its hooks stay eager around the graph, gather its bucket, prefetch the
next and reduce its gradients asynchronously with the other blocks', as in eager (FSDP2's hooks sit around
a compiled block the same way), and the graph sees plain tensors, with no DTensor to unwrap and rewrap at
every call. Should such a block take the DTensor path on some call (inputs not split by batch), its
compiled forward traces that path too, its gathers inside, as a checkpointed block's body does. With
parallelize(comm=...) only such blocks compile (the others are refused: their gathers would be DTensor
redistributes inside the graph, in full precision): their group gathers and reduces on the quantized wire
in the eager hooks, the graph computes, and a call that would take the DTensor path is refused.

Any other block compiles to one graph per block type, with its parameter gathers, layout moves and gradient
reductions inside it as functional collectives, so the compiler sees and schedules them. Inside a compiled
block the pass uses DTensor's own redistribute (the same layouts as in eager, see spmd.runtime.parameters.gather),
inductor buckets the block's collectives of each kind into one (as a flat parameter group does in eager,
spmd.runtime.parameters.group), and
ZeRO-3's reshard-after-forward becomes a selective-checkpoint policy: the gathered parameter is recomputed
(regathered) in backward, not saved. A block under activation checkpointing compiles its body and keeps
torch's checkpoint outside the graph: the recompute in backward runs the same compiled graph (torch 2.13
cannot trace a checkpoint around DTensor collectives: its partitioner saves a DeviceMesh for backward).
The collectives are not recorded (record a step in eager, or use `explain`, for the plan). Gradients reduce
to the grads map's layout in the graph (ZeRO-2 reduce-scatters onto the optimizer's shards; ZeRO-1 leaves
them for the step); under `no_sync` the graph leaves them unreduced and the last micro-batch's backward
reduces the sums once, in flat buffers (spmd.runtime.gradients.accumulate).
Blocks holding expert modules (a mixture of experts) are refused: the token dispatch's split sizes and
tokens per expert are data (the routing), read as Python ints, so dynamo breaks the graph and recompiles
for every routing (on 2 ranks of moe-tiny it hit its recompile limit and the step did not finish in 400 s).
"""

import torch
import torch.nn as nn

from ...layout.annotate import computes_in_float8
from ...layout.blocks import find_blocks
from ..experts.dispatch import expert_modules
from ..local.hook_sets import dress_inside
from ..parameters.host import host_params
from ..parameters.reshard import BODY_COMPILED_ATTR, CHECKPOINTED_ATTR
from ..state import STATE_ATTR
from .checkpointing import compile_body

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, blocks: str | None = None, bucket: bool = True, **compile_kwargs) -> list[int]:
    """Compiles the blocks of `model`'s block list in place (parameter names do not change); returns the
    indices compiled (every block). Apply activation checkpointing first: a checkpointed block compiles the
    body its checkpoint recomputes. `bucket` turns on inductor's bucketing of all-gathers, reduce-scatters and
    all-reduces (a global inductor setting): a block's collectives of one kind merge into one, as
    spmd.runtime.parameters.group does in eager. `compile_kwargs` go to `torch.compile`."""
    path, block_list = find_blocks(model, blocks)
    routed = [f"{path}.{i}.{name}" for i, block in enumerate(block_list) for name in expert_modules(block)]
    if routed:
        raise ValueError(
            f"compile_blocks: the blocks hold expert modules ({', '.join(routed[:2])}, ...), whose token "
            f"dispatch has split sizes that depend on the routing: torch.compile breaks the graph and "
            f"recompiles for every routing. Run a mixture of experts without compile_blocks (--compile)"
        )
    if host_params(getattr(model, STATE_ATTR, None)):
        raise ValueError(
            "compile_blocks does not support parallelize(offload='params') (a compiled block gathers "
            "parameters where they are stored); leave the blocks eager, or use offload='optimizer'"
        )
    _refuse_wire_in_graph(getattr(model, STATE_ATTR, None), path, block_list)
    if bucket:
        from torch._inductor import config as inductor_config

        inductor_config.bucket_all_gathers_fx = "all"
        inductor_config.bucket_reduce_scatters_fx = "all"
        inductor_config.bucket_all_reduces_fx = "all"
    if any(computes_in_float8(m) for m in model.modules()):
        compile_kwargs.setdefault("dynamic", False)  # dynamo's dynamic-shape recompile fails on torchao's float8
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        compiled = (*state.compiled_params, *(p for block in block_list for p in block.parameters()))
        state.compiled_params = list({id(p): p for p in compiled}.values())  # each once, however often called
    local = {} if state is None else state.local_members  # blocks that run on local tensors
    for block in block_list:
        if id(block) in local and not getattr(block, CHECKPOINTED_ATTR, False):
            _compile_forward(block, **compile_kwargs)
            continue
        dress_inside(block)  # a compiled block takes the DTensor path (spmd.runtime.local.hook_sets)
        for m in block.modules():
            # hook ids are global counters, and dynamo guards on them being in this set: with it empty,
            # every block of a type shares one graph (in a compiled graph an error aborts it anyway)
            m._forward_hooks_always_called.clear()
        if getattr(block, CHECKPOINTED_ATTR, False):
            compile_body(block, **compile_kwargs)
        else:
            block.compile(**compile_kwargs)
    # blocks of one type share a graph; room for a recompile per block where guards differ (shapes)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(block_list))
    return list(range(len(block_list)))


def _refuse_wire_in_graph(state, path: str, block_list) -> None:
    """With comm= only blocks whose hooks stay eager around their compiled forward compile (data-only layouts,
    not checkpointed): their group gathers and reduces on the quantized wire. The others would gather inside
    the graph through DTensor's redistribute, in full precision."""
    if getattr(state, "wire", None) is None:
        return
    inside = [
        f"{path}.{i}"
        for i, b in enumerate(block_list)
        if id(b) not in state.local_members or getattr(b, CHECKPOINTED_ATTR, False)
    ]
    if inside:
        raise ValueError(
            f"compile_blocks with parallelize(comm=...): {', '.join(inside[:2])}{', ...' if len(inside) > 2 else ''} "
            f"would gather and reduce inside the compiled graph (activation checkpointing, or a layout that is "
            f"not data-only: tp, sp, float8 layers), through DTensor's redistribute, which has no quantized "
            f"wire. Compiled blocks carry comm on dp/fsdp layouts without checkpointing: drop activation "
            f"checkpointing (--ac none) or --compile, or pass comm=None"
        )


def _compile_forward(block: nn.Module, **compile_kwargs) -> None:
    """torch.compile a block's forward alone, its hooks left eager around it; on a DTensor-path call the graph
    gathers the parameters itself, as a checkpointed block's compiled body does."""
    block.forward = torch.compile(block.forward, **compile_kwargs)
    setattr(block, BODY_COMPILED_ATTR, True)
