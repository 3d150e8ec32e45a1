"""transformers' defaults on every spec: a model annotated by `spmd.annotate_by_name` keeps its config's
`use_cache=True`, which makes transformers build a key/value cache in every call (spmd.runtime.activations.kv_cache).

One launch of 4 processes: Llama on tp=4 and fsdp=2,tp=2,sp and Qwen2 on fsdp=2,tp=2,sp, called as
`model(input_ids=x, labels=x)`, train 2 AdamW steps as one process does (the reference builds its cache):
loss, every gradient and every parameter within 1e-5, norm-relative, in fp32 (tests.test_any_model's
comparison). A training call returns no cache and leaves the user's config as it was; in eval mode under
no_grad the model builds its cache on tp=4, and the next token's logits, decoded from that cache, equal one
process's within 1e-5; transformers' `generate` is refused on every rank, naming the step-by-step route.

Mutations that fail it: the training call's `use_cache=False` hook not installed (a cache comes back from
training); spmd.runtime.plain's concatenation not skipping a 1-D empty tensor (the eval cache fails to
start: DTensor's `Shard._split_tensor` IndexError); both (the training steps fail as reported).
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

import spmd
from tests.dist_utils import run_distributed
from tests.test_any_model import _local, _matches_one_device, batch, build

pytest.importorskip("transformers")

TOL = 1e-5


def _default_cache(rank, world):
    _matches_one_device(rank, world, "llama:by_name", ["tp=4", "fsdp=2,tp=2,sp"], tol=TOL)
    _matches_one_device(rank, world, "qwen2:by_name", ["fsdp=2,tp=2,sp"], tol=TOL)
    mesh = spmd.make_mesh({"tp": 4})
    ref, _ = build("llama:by_name")
    model, _ = build("llama:by_name")
    spmd.parallelize(model, mesh, spmd.Rules.default())
    tokens = _local(batch(0), mesh)
    out = model(input_ids=tokens, labels=tokens)
    assert "cache" not in out and "past_key_values" not in out, list(out.keys())
    assert model.config.use_cache is True  # the user's setting, for generation, is left as it was
    model.eval(), ref.eval()
    with torch.no_grad():
        prompt, step = batch(1)[:, :8], batch(2)[:, :1]
        cache = model(input_ids=_local(prompt, mesh)).cache
        ref_cache = ref(input_ids=prompt).cache
        assert cache.get_seq_length() == 8
        logits = model(input_ids=_local(step, mesh), cache=cache).logits
        ref_logits = ref(input_ids=step, cache=ref_cache).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    err = (logits - ref_logits).norm() / ref_logits.norm()
    assert err <= TOL, f"logits decoded from the cache off by {err:.2e}"
    with pytest.raises(NotImplementedError, match=r"generate\(\) does not run .*model\(input_ids=ids, cache=cache\)"):
        model.generate(_local(prompt, mesh), max_new_tokens=2)


@pytest.mark.slow
def test_default_use_cache_trains_as_one_device():
    run_distributed(_default_cache, 4, timeout_s=600)
