"""Cross-entropy in Triton: one program per row walks the vocab in blocks with an online softmax
(running max and rescaled sum of exp), so any vocab size fits. Mean over the rows whose target is not
ignore_index, in fp32.

`ce_rows_forward` / `ce_rows_backward` are the two kernels as functions; linear_cross_entropy reuses them
per token chunk, writing the gradient over the chunk's logits in place.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_fwd(LOGITS, TARGETS, LOSS, ROW_MAX, LOG_SUM, n_cols, stride_row, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    # max and log-sum kept apart: m + log(s) would round at the scale of the logits
    log_s = tl.log(s)
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    x_target = tl.load(ptr + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(ROW_MAX + row, m)
    tl.store(LOG_SUM + row, log_s)
    tl.store(LOSS + row, tl.where(valid, (m - x_target) + log_s, 0.0))


@triton.jit
def _ce_bwd(
    LOGITS,
    TARGETS,
    ROW_MAX,
    LOG_SUM,
    SCALE,
    DLOGITS,
    n_cols,
    stride_row,
    dstride_row,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    m = tl.load(ROW_MAX + row)
    log_s = tl.load(LOG_SUM + row)
    scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp((x - m) - log_s) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(DLOGITS + row * dstride_row + cols, g.to(DLOGITS.dtype.element_ty), mask=mask)


def _block(n_cols: int, block: int | None) -> int:
    return block or min(triton.next_power_of_2(n_cols), 4096)


def ce_rows_forward(logits, targets, ignore_index: int, block: int | None = None):
    """Per-row loss (0 where ignored), fp32 [N], and stats: fp32 [2, N], the row max and log(sum(exp(x - max))).
    logits [N, V] with unit stride along V."""
    n = logits.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    stats = torch.empty(2, n, dtype=torch.float32, device=logits.device)
    if n > 0:
        _ce_fwd[(n,)](
            logits,
            targets,
            loss,
            stats[0],
            stats[1],
            logits.shape[1],
            logits.stride(0),
            ignore_index,
            BLOCK=_block(logits.shape[1], block),
        )
    return loss, stats


def ce_rows_backward(logits, targets, stats, scale, ignore_index: int, out=None, block: int | None = None):
    """(softmax - onehot) * scale per row, 0 for ignored rows; scale is a 1-element fp32 tensor.
    `out` may be `logits` itself: each element is read before it is overwritten."""
    out = torch.empty_like(logits) if out is None else out
    n = logits.shape[0]
    if n > 0:
        _ce_bwd[(n,)](
            logits,
            targets,
            stats[0],
            stats[1],
            scale,
            out,
            logits.shape[1],
            logits.stride(0),
            out.stride(0),
            ignore_index,
            BLOCK=_block(logits.shape[1], block),
        )
    return out


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, block):
        loss, stats = ce_rows_forward(logits, targets, ignore_index, block)
        count = (targets != ignore_index).sum().float()
        ctx.save_for_backward(logits, targets, stats, count)
        ctx.ignore_index, ctx.block = ignore_index, block
        return loss.sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, targets, stats, count = ctx.saved_tensors
        scale = (grad.float() / count).reshape(1)
        return ce_rows_backward(logits, targets, stats, scale, ctx.ignore_index, block=ctx.block), None, None, None


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, block: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of [N, V] logits against [N] targets; `block` overrides the vocab tile width."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy needs logits [N, V] and targets [N], got {tuple(logits.shape)}, {tuple(targets.shape)}"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return CrossEntropyFunction.apply(logits, targets.contiguous(), ignore_index, block)
