"""Triton kernels against the plain-torch references, forward and backward, on CPU under the Triton
interpreter (exact semantics, slow, so the shapes are tiny).

Tolerances: fp32 1e-5. bf16: the kernels compute in fp32 and round once on store, as the references do
per op, so outputs agree to a rounding or two (1/rsqrt differences can flip one intermediate rounding);
we allow 2 bf16 ulps relative (2**-6) plus a small absolute term for values near zero, and 3e-2 for
gradients that the reference sums in bf16 in another order.
"""

import pytest
import torch
from dist_utils import run_distributed

import kernels
from kernels import reference

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2**-6, atol=1e-2)


def _run(fn, inputs, grads=None):
    """Outputs and input gradients of fn(*inputs) for a fixed random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    if grads is None:
        gen = torch.Generator().manual_seed(1)
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [t.grad for t in leaves if t.grad is not None]


def _compare(triton_fn, ref_fn, inputs, tol, grad_tol=None):
    got_out, got_grad = _run(triton_fn, inputs)
    want_out, want_grad = _run(ref_fn, inputs)
    assert len(got_grad) == len(want_grad) > 0
    for got, want in zip(got_out, want_out):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(got_grad, want_grad):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **(grad_tol or tol))


def _randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("shape", [(3, 5, 37), (4, 64)])
def test_rms_norm_fp32(shape):
    x, w = _randn(*shape), _randn(shape[-1], seed=1)
    _compare(
        lambda x, w: kernels.rms_norm(x, w, 1e-5, impl="triton"),
        lambda x, w: reference.rms_norm(x, w, 1e-5),
        [x, w],
        FP32,
    )


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_bf16(w_dtype):
    x, w = _randn(6, 40, dtype=torch.bfloat16, scale=3), _randn(40, dtype=w_dtype, seed=1)
    _compare(
        lambda x, w: kernels.rms_norm(x, w, 1e-5, impl="triton"),
        lambda x, w: reference.rms_norm(x, w, 1e-5),
        [x, w],
        BF16,
        dict(rtol=3e-2, atol=3e-2),
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_swiglu(dtype, tol):
    # 2 x 1100 elements: two 1024-wide blocks, the second with a masked tail
    gate, up = _randn(2, 1100, dtype=dtype, scale=3), _randn(2, 1100, dtype=dtype, seed=1)
    _compare(lambda g, u: kernels.swiglu(g, u, impl="triton"), reference.swiglu, [gate, up], tol)


def _rope_tables(T, D, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    emb = torch.outer(torch.arange(T, dtype=torch.float32), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_rope(dtype, tol):
    # 3 query heads, 1 kv head, head_dim 12 (half 6: masked tails in both tile dims)
    q, k = _randn(2, 5, 3, 12, dtype=dtype), _randn(2, 5, 1, 12, dtype=dtype, seed=1)
    cos, sin = _rope_tables(5, 12)
    _compare(
        lambda q, k: kernels.apply_rope(q, k, cos, sin, impl="triton"),
        lambda q, k: reference.apply_rope(q, k, cos, sin),
        [q, k],
        tol,
    )


def test_rope_any_tables():
    # tables whose halves differ catch a swapped cos/sin index in either direction
    q, k = _randn(1, 4, 2, 8), _randn(1, 4, 2, 8, seed=1)
    cos, sin = _randn(4, 8, seed=2), _randn(4, 8, seed=3)
    _compare(
        lambda q, k: kernels.apply_rope(q, k, cos, sin, impl="triton"),
        lambda q, k: reference.apply_rope(q, k, cos, sin),
        [q, k],
        FP32,
    )


def _targets(n, vocab, seed=0):
    t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    t[::4] = -100
    t[1] = vocab - 1  # the last column, in the masked tail of the last vocab block
    return t


@pytest.mark.parametrize("block", [16, None])  # 16: three vocab blocks per row (online softmax); None: one
def test_cross_entropy_fp32(block):
    from kernels.cross_entropy import cross_entropy as triton_ce

    logits, targets = _randn(9, 37, scale=4), _targets(9, 37)
    _compare(
        lambda x: triton_ce(x, targets, block=block), lambda x: reference.cross_entropy(x, targets), [logits], FP32
    )


def test_cross_entropy_large_logits_and_bf16():
    targets = _targets(6, 50)
    # logits near 1e4: exp overflows without the running max
    _compare(
        lambda x: kernels.cross_entropy(x, targets, impl="triton"),
        lambda x: reference.cross_entropy(x, targets),
        [_randn(6, 50, scale=5) + 1e4],
        FP32,
    )
    _compare(
        lambda x: kernels.cross_entropy(x, targets, impl="triton"),
        lambda x: reference.cross_entropy(x, targets),
        [_randn(6, 50, dtype=torch.bfloat16, scale=4)],
        BF16,
    )


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("chunk", [4, 13])
def test_linear_cross_entropy_fp32(use_triton, chunk):
    """Loss, d_hidden and d_weight within 1e-5 of F.cross_entropy(h @ W.T) (fp32), with ignored tokens: chunks
    of 4 tokens (4 + 4 + 4 + a tail of 1, one chunk with no counted token) and one chunk of all 13.
    Mutation: counting ignored rows in the gradient (mask dropped from the scale) fails d_hidden/d_weight."""
    from kernels.linear_cross_entropy import linear_cross_entropy as chunked

    targets = _targets(13, 37)
    targets[8:12] = -100
    _compare(
        lambda h, w: chunked(h, w, targets, chunk_size=chunk, use_triton=use_triton),
        lambda h, w: reference.linear_cross_entropy(h, w, targets),
        [_randn(13, 8, scale=3), _randn(37, 8, seed=1)],
        FP32,
    )


def test_linear_cross_entropy_bf16_default_chunks():
    targets = _targets(24, 40)
    _compare(
        lambda h, w: kernels.linear_cross_entropy(h, w, targets, impl="triton"),
        lambda h, w: reference.linear_cross_entropy(h, w, targets),
        [_randn(24, 16, dtype=torch.bfloat16), _randn(40, 16, dtype=torch.bfloat16, seed=1)],
        BF16,
        dict(rtol=3e-2, atol=3e-3),
    )


def test_linear_cross_entropy_default_chunk_bounds_the_logits():
    """Llama-3-8B: 8192 tokens x 128256 vocab goes in two [4096, V] blocks (1 GiB each in bf16)."""
    from kernels.linear_cross_entropy import CHUNK_ELEMENTS, default_chunk_size

    assert default_chunk_size(8192, 4096, 128256) == 4096
    assert default_chunk_size(100, 64, 1000) == 100
    for n, v in [(8192, 128256), (65536, 32000), (3, 2**31)]:
        c = default_chunk_size(n, 64, v)
        assert c == 1 or (c * v <= CHUNK_ELEMENTS and 2 * c * v > CHUNK_ELEMENTS) or c == n


@pytest.mark.parametrize("use_triton", [True, False])
def test_linear_cross_entropy_never_holds_full_logits(use_triton):
    """Peak bytes of live tensors made during forward+backward (storages counted while alive, as
    benchmarks.tensor_memory measures them): eager holds the [32, 512] fp32 logits (64 KiB) and their
    softmax at once; the chunked version stays below one full logits' size, within one [4, 512] block
    plus the gradients (the Triton interpreter adds a host copy of the block per kernel argument).
    Mutation: ignoring chunk_size (one chunk of all tokens) fails the bound."""
    from benchmarks.tensor_memory import LiveTensorBytes
    from kernels.linear_cross_entropy import linear_cross_entropy as chunked

    n, hidden, vocab, chunk = 32, 2, 512, 4
    h = _randn(n, hidden).requires_grad_()
    w = _randn(vocab, hidden, seed=1).requires_grad_()
    full_logits, block = n * vocab * 4, chunk * vocab * 4
    with LiveTensorBytes() as naive:
        reference.linear_cross_entropy(h, w, _targets(n, vocab)).backward()
    h.grad = w.grad = None
    with LiveTensorBytes() as fused:
        chunked(h, w, _targets(n, vocab), chunk_size=chunk, use_triton=use_triton).backward()
    assert naive.peak >= 2 * full_logits
    gradients = 2 * (n * hidden + vocab * hidden) * 4  # stored in forward, scaled copies in backward
    blocks = 3 if use_triton else 1
    assert fused.peak < full_logits
    assert fused.peak <= blocks * block + gradients + 4096  # 4 KiB: per-row statistics, targets, scalars


def test_bad_impl_is_rejected():
    with pytest.raises(ValueError, match="impl"):
        kernels.swiglu(torch.ones(2), torch.ones(2), impl="cuda")


def test_llama_triton_matches_torch():
    from models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :3] = -100
    results = {}
    for impl in ("torch", "triton"):
        model = Llama(LlamaConfig.preset("tiny", kernels=impl))
        model.reset_parameters(seed=0)
        loss = model(inputs, targets)
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    torch.testing.assert_close(loss_k, loss_t, **FP32)
    assert grads_k.keys() == grads_t.keys()
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-4, atol=1e-6, msg=name)


def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def dist(t, *placements):
        return distribute_tensor(t, mesh, list(placements), src_data_rank=None).requires_grad_()

    def both(fn, make_inputs):
        results = []
        for impl in ("torch", "triton"):
            inputs = make_inputs()
            out = fn(*inputs, impl=impl)
            outs = out if isinstance(out, tuple) else (out,)
            sum((o.float() * o.float()).sum() for o in outs).backward()
            results.append(
                (
                    [o.full_tensor() for o in outs],
                    [(t.grad.placements, t.grad.full_tensor()) for t in inputs if t.requires_grad],
                )
            )
        (want_out, want_grad), (got_out, got_grad) = results
        for got, want in zip(got_out, want_out):
            torch.testing.assert_close(got, want, **FP32)
        for (got_pl, got), (want_pl, want) in zip(got_grad, want_grad):
            assert got_pl == want_pl
            torch.testing.assert_close(got, want, **FP32)

    x, w = _randn(4, 6, 10), _randn(10, seed=1)
    for pl in (Shard(0), Shard(1)):
        both(lambda x, w, impl: kernels.rms_norm(x, w, 1e-5, impl=impl), lambda: (dist(x, pl), dist(w, Replicate())))
    both(kernels.swiglu, lambda: (dist(x, Shard(2)), dist(w.expand(4, 6, 10).contiguous(), Shard(2))))
    q, k = _randn(2, 5, 4, 8), _randn(2, 5, 2, 8, seed=1)
    cos, sin = (distribute_tensor(t, mesh, [Replicate()], src_data_rank=None) for t in _rope_tables(5, 8))
    both(
        lambda q, k, impl: kernels.apply_rope(q, k, cos, sin, impl=impl), lambda: (dist(q, Shard(2)), dist(k, Shard(0)))
    )

    with pytest.raises(ValueError, match="last"):
        kernels.rms_norm(dist(x, Shard(2)), dist(w, Replicate()), impl="triton")
    with pytest.raises(ValueError, match="sequence"):
        kernels.apply_rope(dist(q, Shard(1)), dist(k, Shard(1)), cos, sin, impl="triton")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_triton_on_dtensor_local_shards():
    run_distributed(_dtensor_worker, 2, timeout_s=150)
