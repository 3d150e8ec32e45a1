"""What a pipeline stage costs in FLOPs (spmd.pipeline.split balances stages by it): one forward of the model on
fake tensors under FlopCounterMode, split into the FLOPs before the blocks, per block and after them, and the
order in which the modules outside the blocks run."""

import torch
import torch.nn as nn

from ..runtime.experts.dispatch import balanced_routing
from .shapes import fake_inputs, fake_model

__all__ = ["default_example", "count_flops", "stage_flops", "path_of"]


def default_example(model: nn.Module):
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    seq = min(int(getattr(cfg, "max_seq_len", 0) or getattr(cfg, "max_position_embeddings", 0) or 128), 2048)
    return (torch.zeros(1, seq, dtype=torch.long),)


def count_flops(model: nn.Module, block_list: nn.ModuleList, example_inputs):
    """(FLOPs before the blocks, per block, after the blocks, names of modules run before/after), forward only,
    on a fake-tensor copy of the model."""
    from torch.utils.flop_counter import FlopCounterMode

    meta, mode = fake_model(model)
    meta_blocks = meta.get_submodule(path_of(model, block_list))
    counter = FlopCounterMode(display=False)
    total = lambda: sum(counter.flop_counts["Global"].values())  # noqa: E731
    marks, order = {}, []
    block_ids = {id(b) for b in meta_blocks}
    inside = {id(m) for b in meta_blocks for m in b.modules()}
    hooks = [
        meta_blocks[0].register_forward_pre_hook(lambda m, a: (marks.setdefault("start", total()), None)[1]),
        meta_blocks[-1].register_forward_hook(lambda m, a, o: marks.__setitem__("end", total())),
    ]
    names = {id(m): n for n, m in meta.named_modules()}
    for m in meta.modules():
        if id(m) not in inside or id(m) in block_ids:
            hooks.append(
                m.register_forward_pre_hook(
                    lambda mod, a: order.append((names[id(mod)], "start" in marks and "end" in marks))
                )
            )
    inputs = fake_inputs(mode, example_inputs)
    try:
        with mode, counter, torch.no_grad(), balanced_routing(meta):
            meta(*inputs)
    finally:
        for h in hooks:
            h.remove()
    if "start" not in marks:
        raise ValueError("the forward of the example input never ran the blocks; pass example_inputs that do")
    per_block = []
    prefix = (
        f"{type(meta).__name__}.{path_of(model, block_list)}."
        if path_of(model, block_list)
        else f"{type(meta).__name__}."
    )
    counts = counter.get_flop_counts()
    for i in range(len(meta_blocks)):
        per_block.append(sum(counts.get(f"{prefix}{i}", {}).values()))
    return marks["start"], per_block, total() - marks["end"], order


def path_of(model: nn.Module, target: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is target:
            return name
    raise ValueError("the block list is not a submodule of the model")


def stage_flops(model: nn.Module, block_list, cost: str, example_inputs):
    """_countcount_flops on the example inputs; balanced by parameters, FLOPs are only reported, when the default
    input runs the model (else None: "not counted")."""
    if cost == "flops" or example_inputs is not None:
        return count_flops(model, block_list, example_inputs if example_inputs is not None else default_example(model))
    try:
        return count_flops(model, block_list, default_example(model))
    except Exception:  # noqa: BLE001  (a model that takes other inputs)
        return None
