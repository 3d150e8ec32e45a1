"""The reach into torch's torch-function mode stack and autograd engine: taking a mode off the top of the stack
for a while (and putting it back), and queueing a callback for the end of the running backward."""

import torch

__all__ = ["suspend_top", "resume", "after_backward"]


def suspend_top(mode):
    """Takes `mode` off the torch-function stack when it is on top and returns it, to `resume`; else None."""
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        return None
    return torch._C._pop_torch_function_stack()


def resume(mode) -> None:
    """Puts back a mode `suspend_top` took off (None: nothing)."""
    if mode is not None:
        torch._C._push_on_torch_function_stack(mode)


def after_backward(callback) -> None:
    """Runs `callback` when the running backward pass ends (autograd's engine callback)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
