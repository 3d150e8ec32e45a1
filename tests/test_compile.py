"""spmd.compile_blocks in one process: which blocks it compiles, and that compiling leaves the numbers alone.

The multi-process proof (a compiled fsdp x tp x sp model matches one device, every block one graph) is
tests/test_spmd_numerics.py::test_compiled_blocks_match_one_device; the trainer's --compile is in
tests/test_train.py.
"""
import torch

import spmd
from tests.spmd_cases import global_batch, tiny_model


def test_checkpointed_blocks_stay_eager_and_gradients_are_unchanged():
    ref, model = tiny_model(n_layers=4), tiny_model(n_layers=4)
    assert spmd.apply_activation_checkpointing(model, "selective:2") == [0, 2]
    # backend "eager" runs dynamo's captured graph without inductor: same ops, same order, so exact
    assert spmd.compile_blocks(model, backend="eager") == [1, 3]
    tokens, targets = global_batch(0)
    ref(tokens, targets).backward()
    model(tokens, targets).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_params[name].grad), name
