"""RMSNorm in Triton: y = x / rms(x) * weight over the last dim, statistics in fp32.

Forward: one program per row, saves 1/rms per row. Backward: each program walks a band of rows, writes dx
and accumulates its partial dweight in fp32; the partials are summed in torch.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    # round the normalized row to x's dtype before the weight, as the reference does
    xn = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (xn * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xn = x * rstd
        g = dy * w
        dx = rstd * (g - xn * (tl.sum(g * xn, axis=0) / n_cols))
        tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xn
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _num_programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape, n_cols = x.shape, x.shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()
        weight = weight.contiguous()
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n_cols)
        if x2.shape[0] > 0:
            _rms_norm_fwd[(x2.shape[0],)](x2, weight, y, rstd, n_cols, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy = dy.reshape(n_rows, n_cols).contiguous()
        dx = torch.empty_like(x2)
        programs = max(_num_programs(n_rows, x2.device), 1)
        dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2.device)
        if n_rows > 0:
            _rms_norm_bwd[(programs,)](
                dy,
                x2,
                weight,
                rstd,
                dx,
                dw_partial,
                n_rows,
                n_cols,
                triton.cdiv(n_rows, programs),
                BLOCK=triton.next_power_of_2(n_cols),
            )
        return dx.view(ctx.shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    return RMSNormFunction.apply(x, weight, eps)
