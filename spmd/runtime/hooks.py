"""The pass's forward hooks on every module, and the phases they dispatch on.

Before a module computes: inputs become DTensors (or run locally), a bucket is gathered, the global view goes on, a
linear layer's input moves to its weight's layout. After: parameters dropped, partial sums reduced. The root's
hooks move the phase (state.Phase); its post-hook leaves whatever was entered (`_unwind`), also when forward raised.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..layout.annotate import out_dim
from ..layout.rules import placements_for
from . import state as active
from . import tags
from .activations.global_view import GlobalView
from .activations.moves import finish_output, move_linear_input
from .activations.partials import reduce_partials
from .dtensor.wrap import as_dtensor
from .gradients.accumulate import reduce_after_backward
from .local import hook_sets
from .local.blocks import enter_local
from .local.edges import map_tensors
from .local.whole_model import enter_local_model
from .parameters.gather import gather_block, gather_module_params, release_module_params
from .state import Phase, SPMDState, tracing

__all__ = ["module_hooks"]


def module_hooks(state: SPMDState, name: str, module: nn.Module, is_root: bool) -> tuple:
    """(pre-hook, post-hook) of `module`; the root's share the depths of the stacks at its entry."""
    # parameters are read at call time, not captured: a compiled graph takes them as inputs, for every block
    params = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
    entry: list = []
    return _pre_hook(state, name, module, is_root, entry, params), _post_hook(state, module, is_root, entry, params)


def _unwind(state: SPMDState, marks: tuple) -> None:
    """Leaves, innermost first, whatever was entered since `marks` and is still entered."""
    local, saved, views, depth, phase = marks
    while len(state.local) > local:
        state.local.pop().leave(None)
    while len(state.saved_hooks) > saved:
        hooks = state.saved_hooks.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
    while len(state.global_view) > views:
        state.global_view.pop()[1].__exit__(None, None, None)
    active.unwind_to(depth)
    state.phase = phase


def _to_dtensor(state: SPMDState, t, key):
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        return t

    def decide():
        axes = state.input_axes.get(key) if isinstance(state.input_axes, dict) else state.input_axes
        axes = axes or ("batch",) + (None,) * (t.dim() - 1)
        dims = state.rules.mesh_axes(axes, "compute", "model input", strict=False)
        if t.dim() > 1 and axes[1] is None and "cp" in state.rules.compute.get("seq", ()):
            dims[1] = ("cp",)  # the data path gives each cp rank its share of the sequence (spmd.cp_slice)
        return placements_for(state.mesh, dims, None, "model input")

    return as_dtensor(t, state.mesh, state.target(("input", key, t.dim()), decide))


def _pre_hook(state: SPMDState, name: str, module: nn.Module, is_root: bool, entry: list, param_names: list):
    kind = out_dim(module)  # 0: nn.Linear, 1: Conv1D (transposed), or an embedding / other layer
    is_linear = kind is not None and not isinstance(module, nn.Embedding)

    def hook(mod, args, kwargs):
        if state.local:  # inside a block running on local tensors (spmd.runtime.local.blocks): nothing moves here
            return None
        compiling = tracing()
        if is_root and not compiling:
            entry.append(
                (len(state.local), len(state.saved_hooks), len(state.global_view), active.depth(), state.phase)
            )
        active.push(state, name)
        if is_root:
            _start_step(state)
        local = None if compiling else (enter_local_model if is_root else enter_local)(state, mod, name, args, kwargs)
        if local is not None:
            return local
        if is_root:
            args = tuple(_to_dtensor(state, a, i) for i, a in enumerate(args))
            kwargs = {k: _to_dtensor(state, v, k) for k, v in kwargs.items()}
        elif not compiling:  # (compile_blocks dresses a block before compiling it)
            hook_sets.dress_inside(mod)  # this call takes the DTensor path: the modules inside move things
        regather = gather_block(state, mod, compiling)  # before the global view (under its mode ops cost twice)
        if not compiling and (is_root or state.phase not in (Phase.FORWARD, Phase.RECOMPUTE)):
            # the root's forward, or a module called alone (not compiled: a guard on the phase would recompile)
            state.global_view.append((mod, GlobalView(state), state.phase))
            state.global_view[-1][1].__enter__()
            state.phase = Phase.FORWARD
        weight_layout = None
        if is_linear and args and isinstance(args[0], DTensor):
            x, weight_layout = move_linear_input(state, name, mod._parameters["weight"], args[0], kind == 1)
            args = (x,) + tuple(args[1:])
        hooks = gather_module_params(state, mod, name, param_names, weight_layout, compiling, regather)
        if not compiling:  # (no hooks under the compiler; the stack's depth is not guarded)
            state.saved_hooks.append(hooks)
        return args, kwargs

    return hook


def _start_step(state: SPMDState) -> None:
    """The root's forward begins: what a forward or backward that stopped early left is forgotten."""
    state.move_cache.clear()
    state.shared_gathers.clear()
    for group in state.groups.values():
        group.prefetched = None
    if state.reducer is not None:
        state.reducer.reset()


def _post_hook(state: SPMDState, module: nn.Module, is_root: bool, entry: list, param_names: list):
    has_children = next(module.children(), None) is not None

    def hook(mod, args, output):
        compiling = tracing()
        try:
            return leave(mod, output, compiling)
        finally:
            if is_root and entry and not compiling:
                _unwind(state, entry.pop())  # nothing left entered, however the forward ended (it may have raised)
                awaits = []  # the output's tensors that a backward will run through
                map_tensors(output, lambda t: awaits.append(t.requires_grad) or t)
                state.phase = Phase.BACKWARD if any(awaits) else Phase.IDLE

    def leave(mod, output, compiling: bool):
        if state.local:
            if state.local[-1].module is not mod:
                return None
            output = state.local.pop().leave(output)
        else:
            hooks = state.saved_hooks.pop() if not compiling and state.saved_hooks else None
            release_module_params(state, mod, param_names, hooks, compiling)
            if has_children:
                state.move_cache.clear()
            else:
                output = map_tensors(output, lambda t: reduce_partials(t, state.rules, mod, tags.current_module()))
            if not compiling and state.global_view and state.global_view[-1][0] is mod:
                _, view, state.phase = state.global_view.pop()
                view.__exit__(None, None, None)
            if is_root:
                output = finish_output(output, tags.current_module())
        if is_root:
            state.shared_gathers.clear()
            if state.sync and state.accumulating:  # the backward that syncs reduces what no_sync accumulated
                if state.compiled_params:
                    output = reduce_after_backward(output, state)
                else:
                    state.accumulating = False
        active.pop()
        return output

    return hook
