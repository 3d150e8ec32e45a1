"""Rotary position embedding in Triton, Hugging Face rotate-half layout: for each head,
out[:h] = x[:h]*cos[:h] - x[h:]*sin[:h] and out[h:] = x[h:]*cos[h:] + x[:h]*sin[h:] (h = head_dim / 2).

One program per (batch, position) rotates every head of that token, loading cos/sin once. The backward is
the transposed rotation, the same kernel with BACKWARD=True. cos and sin are tables, not differentiated.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    X, COS, SIN, Y, seq_len, n_heads, head_dim, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)  # flat (batch, position) index
    pos = token % seq_len
    half = head_dim // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < half
    mask = (h < n_heads) & dmask
    c1 = tl.load(COS + pos * head_dim + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + pos * head_dim + half + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + pos * head_dim + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + pos * head_dim + half + d, mask=dmask, other=0.0).to(tl.float32)
    offs = token * n_heads * head_dim + h * head_dim + d
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + offs, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + offs + half, y2.to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() > 0:
        _rope_kernel[(B * T,)](
            x,
            cos,
            sin,
            y,
            T,
            H,
            D,
            BACKWARD=backward,
            BLOCK_H=triton.next_power_of_2(H),
            BLOCK_D=triton.next_power_of_2(D // 2),
        )
    return y


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq = None if dq is None else _rotate(dq, cos, sin, True)
        dk = None if dk is None else _rotate(dk, cos, sin, True)
        return dq, dk, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [B, T, H, D], k: [B, T, Hkv, D], cos/sin: [T, D]."""
    # q and k are rotated independently: only T and D must agree (their local shards may differ in B or H)
    if q.ndim != 4 or k.ndim != 4 or q.shape[1] != k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rope needs q [B, T, H, D] and k [B, T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    T, D = q.shape[1], q.shape[-1]
    if D % 2 or cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(
            f"rope needs an even head_dim and cos/sin of shape {(T, D)}, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    return RoPEFunction.apply(q, k, cos, sin)
