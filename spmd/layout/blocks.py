"""Finding a model's repeated blocks: the largest nn.ModuleList whose entries share one type."""

import torch.nn as nn

__all__ = ["find_blocks"]


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, nn.ModuleList]:
    """(qualified name, ModuleList) of the repeated blocks, or of the ModuleList called `name`."""
    if name is not None:
        blocks = model.get_submodule(name)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"{name!r} is a {type(blocks).__name__}, not an nn.ModuleList of blocks")
        return name, blocks
    best = None
    for qual, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best[1]):
                best = (qual, module)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of identical blocks; name the block list explicitly"
        )
    return best
