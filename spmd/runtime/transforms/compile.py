"""`compile_blocks(model)`: torch.compile each repeated block of a (parallelized) model.

A block on local tensors (data-only, spmd.runtime.local.blocks) compiles its forward alone, its hooks eager around
the graph as FSDP2's are: they gather, prefetch and reduce its bucket, and the graph sees plain tensors. With
comm= every block compiles so, its group on the quantized wire in those hooks (a tp block's graph takes the
gathered DTensors, its gradients summed to eager's layouts first: gradients.layouts.summed_as_eager); a checkpointed
block compiles its body, its group gathered on the wire by its hooks and again before the recompute. float8 layers
over tp would move float8 tensors inside the graph (their backward's redistribute) and are refused on the wire.
Any other block compiles to one graph per block type, its gathers, layout moves and reductions inside as
functional collectives (DTensor's redistribute, eager's layouts) that inductor buckets per kind; ZeRO-3's regather
becomes a recompute-in-backward policy. A checkpointed block compiles its body, torch's checkpoint outside (torch
2.13 cannot trace one around DTensor collectives). Its collectives are not recorded (record eager, or `explain`).
Gradients reduce to the grads map's layout in the graph; under `no_sync` they stay unreduced and the last
micro-batch's backward reduces the sums once (spmd.runtime.gradients.accumulate). Blocks holding experts are
refused: the dispatch's split sizes are data read as Python ints, and dynamo recompiles for every routing.
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

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, blocks: str | None = None, bucket: bool = True, **compile_kwargs) -> list[int]:
    """Compiles the blocks of `model`'s block list in place (parameter names do not change); returns the
    indices compiled (every block). Apply activation checkpointing first: a checkpointed block compiles the
    body its checkpoint recomputes. `bucket` turns on inductor's bucketing of all-gathers, reduce-scatters and
    all-reduces (a global inductor setting): a block's collectives of one kind merge into one, as
    spmd.runtime.parameters.group does in eager. `compile_kwargs` go to `torch.compile`."""
    path, block_list = find_blocks(model, blocks)
    state = getattr(model, STATE_ATTR, None)
    routed = [f"{path}.{i}.{name}" for i, block in enumerate(block_list) for name in expert_modules(block)]
    if routed:
        raise ValueError(
            f"compile_blocks: the blocks hold expert modules ({', '.join(routed[:2])}, ...), whose token "
            f"dispatch has split sizes that depend on the routing: torch.compile breaks the graph and "
            f"recompiles for every routing. Run a mixture of experts without compile_blocks (--compile)"
        )
    if host_params(state):
        raise ValueError(
            "compile_blocks does not support parallelize(offload='params') (a compiled block gathers "
            "parameters where they are stored); leave the blocks eager, or use offload='optimizer'"
        )
    _refuse_wire_in_graph(state, path, block_list)
    if bucket:
        from torch._inductor import config as inductor_config

        inductor_config.bucket_all_gathers_fx = "all"
        inductor_config.bucket_reduce_scatters_fx = "all"
        inductor_config.bucket_all_reduces_fx = "all"
    if any(computes_in_float8(m) for m in model.modules()):
        compile_kwargs.setdefault("dynamic", False)  # dynamo's dynamic-shape recompile fails on torchao's float8
    if state is not None:
        compiled = (*state.compiled_params, *(p for block in block_list for p in block.parameters()))
        state.compiled_params = list({id(p): p for p in compiled}.values())  # each once, however often called
    local = {} if state is None else state.local_members  # blocks that run on local tensors
    for block in block_list:
        if id(block) in local and not getattr(block, CHECKPOINTED_ATTR, False):
            _compile_in_place(block, "forward", **compile_kwargs)
            continue
        dress_inside(block)  # a compiled block takes the DTensor path (spmd.runtime.local.hook_sets)
        for m in block.modules():
            # hook ids are global counters, and dynamo guards on them being in this set: with it empty,
            # every block of a type shares one graph (in a compiled graph an error aborts it anyway)
            m._forward_hooks_always_called.clear()
        if getattr(block, CHECKPOINTED_ATTR, False):  # on the wire its group gathers around the body too
            _compile_in_place(block, "_spmd_body", **compile_kwargs)
        elif getattr(state, "wire", None) is not None:  # its group on the wire around it
            _compile_in_place(block, "forward", **compile_kwargs)
        else:
            block.compile(**compile_kwargs)
    # blocks of one type share a graph; room for a recompile per block where guards differ (shapes)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(block_list))
    return list(range(len(block_list)))


def _refuse_wire_in_graph(state, path: str, block_list) -> None:
    """With comm= the float8 layers of a block that moves activations (tp) would move their float8 operands
    inside the graph through DTensor's redistribute, which cannot split torchao's float8 tensors."""
    if getattr(state, "wire", None) is None:
        return
    inside = [
        f"{path}.{i}"
        for i, b in enumerate(block_list)
        if any(computes_in_float8(m) and _computes_sharded(m) for m in b.modules())
    ]
    if inside:
        raise ValueError(
            f"compile_blocks with parallelize(comm=...): {', '.join(inside[:2])}{', ...' if len(inside) > 2 else ''} "
            f"hold float8 layers laid out over tp, whose backward would move float8 tensors inside the compiled "
            f"graph through DTensor's redistribute, which cannot split them. Compiled blocks carry comm with "
            f"float8 on data-parallel meshes (dp, fsdp): drop tp, --float8 or --compile, or pass comm=None"
        )


def _computes_sharded(module: nn.Module) -> bool:
    """Whether any of `module`'s own parameters computes sharded (tp), not replicated."""
    return any(not c.is_replicate() for p in module.parameters(recurse=False) for c in p._spmd_compute)


def _compile_in_place(block: nn.Module, name: str, **compile_kwargs) -> None:
    """torch.compile a block's `forward` alone, its hooks left eager around it (on a DTensor-path call the graph
    gathers the parameters itself), or a checkpointed block's `_spmd_body`: the checkpoint stays outside the
    graph and its recompute runs the compiled body again, the block's own hooks eager."""
    setattr(block, name, torch.compile(getattr(block, name), **compile_kwargs))
    setattr(block, BODY_COMPILED_ATTR, True)
