"""Fused output projection + cross-entropy that never holds the full tokens x vocab logits.

The forward walks the tokens in chunks: logits_c = hidden_c @ weight.T, per-row loss and log-sum-exp, then
at once the gradient of the mean loss w.r.t. logits_c (overwriting logits_c), hidden_c's gradient and the
chunk's contribution to weight's gradient (accumulated in fp32). The backward only scales the stored
gradients by the incoming grad. Peak extra memory: one [chunk, V] logits block plus the gradients.

With use_triton the per-chunk cross-entropy runs the Triton kernels of kernels/cross_entropy.py; without,
plain torch does the same per chunk (for CPU and for memory comparisons).
"""
import torch


def _ce_chunk_torch(logits, targets, ignore_index, scale):
    x = logits.float()
    x = x - x.max(dim=1, keepdim=True).values
    log_sum = torch.logsumexp(x, dim=1)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, 0)
    loss = torch.where(valid, log_sum - x.gather(1, safe_t[:, None]).squeeze(1), 0.0)
    g = torch.exp(x - log_sum[:, None])
    g[torch.arange(len(targets), device=x.device), safe_t] -= 1.0
    g *= (valid.float() * scale)[:, None]
    logits.copy_(g)
    return loss


def _ce_chunk_triton(logits, targets, ignore_index, scale):
    from .cross_entropy import ce_rows_backward, ce_rows_forward
    loss, stats = ce_rows_forward(logits, targets, ignore_index)
    ce_rows_backward(logits, targets, stats, scale.reshape(1), ignore_index, out=logits)
    return loss


def default_chunk_size(n_tokens: int, hidden: int, vocab: int) -> int:
    """A power of two near n_tokens * hidden / vocab, so a logits chunk is about the size of `hidden`."""
    target = max(1, -(-n_tokens // max(1, -(-vocab // hidden))))
    return min(n_tokens, 1 << (target - 1).bit_length())


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, use_triton):
        n_tokens = hidden.shape[0]
        count = (targets != ignore_index).sum().float()
        scale = 1.0 / count
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        ce_chunk = _ce_chunk_triton if use_triton else _ce_chunk_torch
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_tokens, chunk_size):
            h = hidden[start:start + chunk_size]
            logits = h @ weight.t()
            loss_sum += ce_chunk(logits, targets[start:start + chunk_size], ignore_index, scale).sum()
            dlogits = logits  # ce_chunk left d(mean loss)/d(logits) in the buffer
            if need_h:
                torch.mm(dlogits, weight, out=grad_h[start:start + chunk_size])
            if need_w:
                if dlogits.dtype == torch.float32:
                    grad_w.addmm_(dlogits.t(), h)
                else:
                    grad_w += dlogits.t() @ h
            del logits, dlogits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad.to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * grad).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_size: int | None = None,
                         use_triton: bool = True) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against targets; hidden [..., H], weight [V, H]."""
    H = hidden.shape[-1]
    hidden, targets = hidden.reshape(-1, H), targets.reshape(-1)
    if weight.ndim != 2 or weight.shape[1] != H or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"linear_cross_entropy needs hidden [N, H], weight [V, H], targets [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    chunk = chunk_size or default_chunk_size(hidden.shape[0], H, weight.shape[0])
    return LinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, max(1, chunk), use_triton)
