"""Which parameter groups a model has: one flat group per repeated block (one collective per block and mesh axis, as
FSDP2's and DDP's flat buffers) and the root unit for the rest. Any other parameter is a group of one, made where
it moves (parameters.gather); compiled blocks leave all of this to the compiler.
"""

from torch.distributed.tensor import DTensor

from ...layout.blocks import find_blocks
from .group import ParamGroup, shard_dims

__all__ = ["make_buckets", "drop_root_unit"]


def make_buckets(model, mesh, wire=None) -> tuple[dict, dict]:
    """({id(module): ParamGroup}, {id(param): ParamGroup}) of the repeated blocks and the root unit, on `wire`."""
    try:
        path, blocks = find_blocks(model)
    except ValueError:
        return {}, {}  # no repeated blocks: every parameter moves on its own
    by_block, by_param, chain = {}, {}, []
    for key, block in blocks._modules.items():  # keys: the blocks' indices in the model (a pipeline stage's too)
        params = list(
            {
                id(p): p
                for p in block.parameters()
                if isinstance(p, DTensor)
                and not getattr(p, "_spmd_shared", False)
                and shard_dims(p.placements, p._spmd_compute, mesh) is not None
            }.values()
        )
        if len(params) > 1:
            b = ParamGroup(f"{path}.{key}" if path else key, block, params, mesh, wire=wire)
            by_block[id(block)] = b
            by_param.update({id(p): b for p in params})
            chain.append(b)
    for a, b in zip(chain, chain[1:]):  # blocks run in list order: each prefetches the next
        a.next, b.prev = b, a
    rest = list(
        {
            id(p): p
            for p in model.parameters()
            if isinstance(p, DTensor)
            and id(p) not in by_param
            and not getattr(p, "_spmd_shared", False)
            and shard_dims(p.placements, p._spmd_compute, mesh) is not None
        }.values()
    )
    if rest:  # the root unit (FSDP2's): gathered once as the model starts, kept until backward
        root = ParamGroup(type(model).__name__, model, rest, mesh, wire=wire)
        root.keep = True
        root.next = chain[0] if chain else None
        by_block[id(model)] = root
        by_param.update({id(p): root for p in rest})
    return by_block, by_param


def drop_root_unit(state, model) -> None:
    """Leaves the parameters outside the blocks out of any bucket: each moves on its own, and is regathered
    in backward rather than kept from forward (a pipeline stage's micro-batches would each keep a copy)."""
    root = state.groups.pop(id(model), None)
    if root is not None:
        for p in root.params:
            state.group_of.pop(id(p), None)
