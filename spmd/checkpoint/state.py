"""State dicts for checkpoints: a model's parameters and persistent buffers, an optimizer's state by name."""

import torch

from ..runtime.optimizer.shard import masters_of

__all__ = ["model_state", "optim_state"]


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once, under their first name) and persistent buffers, by name."""
    state = dict(model.named_parameters())
    seen = {id(p) for p in state.values()}
    non_persistent = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{mod_name}.{b}" if mod_name else b)
    for name, buf in model.named_buffers():
        if name not in non_persistent and id(buf) not in seen:
            state[name] = buf
    return state


def optim_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, init: bool = False
) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state flattened to `<param name>.<key>` (AdamW: exp_avg, exp_avg_sq, step;
    spmd.Muon: momentum_buffer on its matrices).

    The tensors are the optimizer's own, in its layout (sharded per the optimizer map under ZeRO 1/2) (loading fills
    them in place). AdamW creates its state lazily on the first step; `init=True` creates it now, exactly as AdamW
    would, so a checkpoint can be loaded into it.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    # a sharded optimizer's masters (spmd.shard_optimizer) save under their parameters' names: any stage loads
    names.update({i: names[id(p)] for i, p in masters_of(optimizer).items() if id(p) in names})
    out: dict[str, torch.Tensor] = {}
    if init and hasattr(optimizer, "init_state"):  # an optimizer that makes its own state (spmd.Muon)
        optimizer.init_state()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "optimizer holds a parameter that is not in the model; pass the model the optimizer was built from"
                )
            state = optimizer.state[p]
            if not state and init:
                if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                    raise ValueError(
                        f"optim_state(init=True) knows how to create Adam/AdamW state only, "
                        f"not {type(optimizer).__name__}; take one optimizer step first"
                    )
                on_device = group.get("capturable") or group.get("fused")
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    value = state[key] = torch.tensor(float(value), dtype=torch.float32)
                out[f"{names[id(p)]}.{key}"] = value
    return out
