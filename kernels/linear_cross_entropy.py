"""Fused output projection + cross-entropy that never holds the full tokens x vocab logits.

The forward walks the tokens in chunks. Per chunk: logits_c = hidden_c @ weight.T (one cuBLAS matmul), the
rows' log-sum-exp and target logit, and at once the gradient of the mean loss w.r.t. logits_c, written over
logits_c: (softmax - onehot) / n_counted, 0 on rows whose target is ignore_index. Two more matmuls per chunk
give hidden_c's gradient and the chunk's share of weight's gradient, accumulated in fp32 (for bf16/fp16 on
CUDA inside the matmul, `addmm(out_dtype=float32)`; else through a temporary). The backward only scales the
stored gradients by the incoming grad: three matmuls in all, as eager autograd does, without its
[tokens, vocab] fp32 logits, softmax and gradient.

Memory beyond the inputs: one [chunk, V] logits block, weight's gradient (fp32 while accumulating, then in
weight's dtype) and hidden's. The default chunk bounds the block at 2**29 elements (1 GiB in bf16); few,
large chunks keep the matmuls efficient and the fp32 accumulation passes over weight's gradient few.

With use_triton the per-chunk softmax/gradient pass runs the Triton row kernels of kernels/cross_entropy.py
(one read for the statistics, one read and in-place write for the gradient); without, plain torch does the
same per chunk (CPU, and memory comparisons).
"""

import torch

CHUNK_ELEMENTS = 2**29  # largest [chunk, vocab] logits block the default chunk size allows


def _ce_chunk_torch(logits, targets, ignore_index, scale):
    """Per-row loss of the chunk; leaves d(mean loss)/d(logits) in `logits`."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, 0)
    rows = torch.arange(len(targets), device=x.device)
    x_target = x[rows, safe_t]
    log_z = torch.logsumexp(x, dim=1)
    loss = torch.where(valid, log_z - x_target, 0.0)
    x.sub_(log_z[:, None]).exp_()
    x[rows, safe_t] -= 1.0
    x.mul_((valid.to(x.dtype) * scale)[:, None])
    if x is not logits:
        logits.copy_(x)
    return loss


def _ce_chunk_triton(logits, targets, ignore_index, scale):
    from .cross_entropy import ce_rows_backward, ce_rows_forward

    loss, stats = ce_rows_forward(logits, targets, ignore_index)
    ce_rows_backward(logits, targets, stats, scale.reshape(1), ignore_index, out=logits)
    return loss


def default_chunk_size(n_tokens: int, hidden: int, vocab: int) -> int:
    """The largest power of two of tokens whose [chunk, vocab] logits stay within CHUNK_ELEMENTS (at most all
    the tokens). `hidden` is accepted for callers that size by it; the bound is on the logits alone."""
    del hidden
    fit = max(1, CHUNK_ELEMENTS // max(1, vocab))
    return max(1, min(n_tokens, 1 << (fit.bit_length() - 1)))


_MIXED_ADDMM: dict = {}  # device type -> whether addmm(out_dtype=float32) accumulates bf16/fp16 products


def _mixed_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per device type and dtype: the op exists on CUDA (not on CPU) and must agree with the
    plain path on a small case before it is trusted."""
    key = (device.type, dtype)
    if key not in _MIXED_ADDMM:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(16, 16, generator=gen).to(device, dtype) for _ in range(2))
        a = a.t()  # transposed, as dlogits.t() is
        acc, want = torch.ones(16, 16, device=device), 1.0 + (a.float() @ b.float())
        try:  # accumulating in place, as _accumulate calls it
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _MIXED_ADDMM[key] = bool(torch.allclose(acc, want, rtol=1e-2, atol=1e-2))
        except (RuntimeError, NotImplementedError, TypeError):
            _MIXED_ADDMM[key] = False
    return _MIXED_ADDMM[key]


def _accumulate(grad_w, dlogits_t, h, first: bool) -> None:
    """grad_w (fp32) += dlogits_t @ h, or = on the first chunk."""
    beta = 0.0 if first else 1.0  # beta 0: grad_w's uninitialised contents are not read
    if dlogits_t.dtype == torch.float32:
        grad_w.addmm_(dlogits_t, h, beta=beta)
    elif _mixed_addmm_works(grad_w.device, dlogits_t.dtype):
        torch.addmm(grad_w, dlogits_t, h, beta=beta, out_dtype=torch.float32, out=grad_w)
    elif first:
        grad_w.copy_(dlogits_t @ h)
    else:
        grad_w += dlogits_t @ h


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, use_triton):
        n_tokens = hidden.shape[0]
        count = (targets != ignore_index).sum().float()
        scale = 1.0 / count
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        ce_chunk = _ce_chunk_triton if use_triton else _ce_chunk_torch
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_tokens, chunk_size):
            h = hidden[start : start + chunk_size]
            logits = h @ weight.t()
            loss_sum += ce_chunk(logits, targets[start : start + chunk_size], ignore_index, scale).sum()
            dlogits = logits  # ce_chunk left d(mean loss)/d(logits) in the buffer
            if need_h:
                torch.mm(dlogits, weight, out=grad_h[start : start + chunk_size])
            if need_w:
                _accumulate(grad_w, dlogits.t(), h, first=start == 0)
            del logits, dlogits
        if grad_w is not None and n_tokens == 0:
            grad_w.zero_()
        # stored in weight's dtype: the fp32 copy would hold twice the memory until backward
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad.to(grad_h.dtype)
        dw = None if grad_w is None else grad_w * grad.to(grad_w.dtype)
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    use_triton: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against targets over the tokens whose target is not
    ignore_index; hidden [..., H], weight [V, H], targets [...]. chunk_size: tokens per logits block."""
    H = hidden.shape[-1]
    hidden, targets = hidden.reshape(-1, H), targets.reshape(-1)
    if weight.ndim != 2 or weight.shape[1] != H or targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"linear_cross_entropy needs hidden [N, H], weight [V, H], targets [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy chunk_size must be a positive number of tokens, got {chunk_size}")
    chunk = chunk_size or default_chunk_size(hidden.shape[0], H, weight.shape[0])
    return LinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, chunk, use_triton)
