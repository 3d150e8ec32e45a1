"""Which modules carry the pass's forward hooks.

All of them, except the insides of blocks that may run on local tensors (local.blocks), where nothing moves and a
hook only slows nn.Module's call. Those get their hooks back (`dress_inside`) the first time the block takes the
DTensor path, or before it is compiled. A module with hooks of its own keeps the pass's, so the order holds.
"""

import torch.nn as nn

__all__ = ["install", "strip_inside", "dress_inside"]

_HOOKS = "_spmd_hooks"  # on a module: [pre-hook, post-hook, their handles or None while they are off]
_BARE = "_spmd_bare_inside"  # on a block: its insides' hooks are off


def install(module: nn.Module, pre, post) -> None:
    setattr(module, _HOOKS, [pre, post, _register(module, pre, post, prepend=False)])


def strip_inside(block: nn.Module) -> None:
    """Takes the pass's hooks off the modules inside `block` that carry no other forward hooks."""
    for m in list(block.modules())[1:]:
        hooks = getattr(m, _HOOKS, None)
        if hooks is None or hooks[2] is None or len(m._forward_pre_hooks) + len(m._forward_hooks) > 2:
            continue
        for handle in hooks[2]:
            handle.remove()
        hooks[2] = None
        setattr(block, _BARE, True)


def dress_inside(block: nn.Module) -> None:
    """Puts the pass's hooks back on the modules inside `block`, ahead of any registered since."""
    if not getattr(block, _BARE, False):
        return
    for m in list(block.modules())[1:]:
        hooks = getattr(m, _HOOKS, None)
        if hooks is not None and hooks[2] is None:
            hooks[2] = _register(m, hooks[0], hooks[1], prepend=True)
    setattr(block, _BARE, False)


def _register(module: nn.Module, pre, post, prepend: bool) -> tuple:
    return (
        module.register_forward_pre_hook(pre, with_kwargs=True, prepend=prepend),
        module.register_forward_hook(post, always_call=True, prepend=prepend),
    )
