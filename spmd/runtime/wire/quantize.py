"""Block-wise symmetric quantization of flat payloads, one fp32 scale per block of `block` values.

A block's scale is its largest magnitude over the format's largest code. int8 (-127..127) rounds to the
nearest code; int4 (-7..7, two per byte, low nibble first) rounds stochastically, free of nearest rounding's
bias toward zero, its draw a hash of the scaled value's bits (stateless, reproducible), in finer blocks
(`INT4_BLOCK`, as ZeRO++'s 4-bit groups); fp8 is e4m3 (largest 448: at most 2^-4 of the value, 2^-10 of the
scale among subnormals). A row packs as codes then scales: `packed_bytes(L)` = payload + 4 * ceil(L / block).
"""

import math

import torch

__all__ = ["DEFAULT_BLOCK", "INT4_BLOCK", "FORMATS", "BLOCKWISE", "quantize", "dequantize", "packed_bytes"]

# DeepSpeed's ZeRO++ quantizer (CUDAQuantizer) aims at groups of about 4k values (target at most 8000)
DEFAULT_BLOCK = 4096
INT4_BLOCK = 256
FORMATS = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}  # format -> largest code
BLOCKWISE = tuple(FORMATS)  # (comm's "float8" is tensorwise: spmd.runtime.wire.float8)


def _payload_bytes(n: int, fmt: str) -> int:
    return (n + 1) // 2 if fmt == "int4" else n


def packed_bytes(n: int, fmt: str, block: int) -> int:
    """Bytes one row of `n` values occupies on the wire: codes + one fp32 scale per block."""
    return _payload_bytes(n, fmt) + 4 * math.ceil(n / block)


def _parts(n: int, block: int) -> list[tuple[int, int, int]]:
    """(start, stop, values per block) of the whole blocks and of the short last one: each part a view of
    the row, no padded copy."""
    whole = n // block * block
    return [(a, b, k) for a, b, k in ((0, whole, block), (whole, n, n - whole)) if b > a]


def quantize(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """(rows, L) values -> (rows, packed_bytes(L)) uint8: each row's codes then its fp32 scales."""
    rows, n = x.shape
    x = x.float()
    codes, scales = [], []
    for a, b, k in _parts(n, block):
        blocks = x[:, a:b].reshape(rows, -1, k)
        scale = blocks.abs().amax(-1, keepdim=True).div_(FORMATS[fmt])
        scaled = blocks / torch.where(scale > 0, scale, 1.0)
        if fmt == "fp8":
            codes.append(scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(rows, -1))
        else:
            ints = _round(scaled, fmt).clamp_(-FORMATS[fmt], FORMATS[fmt]).to(torch.int8).reshape(rows, -1)
            codes.append(ints.view(torch.uint8) if fmt == "int8" else ints)
        scales.append(scale.reshape(rows, -1))
    payload = torch.cat(codes, dim=1)
    if fmt == "int4":
        payload = _pack_nibbles(torch.nn.functional.pad(payload, (0, n % 2)))
    return torch.cat([payload, torch.cat(scales, dim=1).view(torch.uint8)], dim=1)


def _round(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """int8: to the nearest code; int4: up with probability equal to the fraction (murmur3's finalizer)."""
    if fmt != "int4":
        return scaled.round_()
    h = scaled.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = ((h ^ (h >> shift)) * mult) & 0xFFFFFFFF
    return scaled.add_(((h ^ (h >> 16)) >> 8).float() / 2.0**24).floor_()  # 24 bits: never 1.0


def dequantize(packed: torch.Tensor, n: int, fmt: str, block: int) -> torch.Tensor:
    """(rows, packed_bytes(n)) uint8 -> (rows, n) fp32 values."""
    rows, payload = packed.shape[0], _payload_bytes(n, fmt)
    scale = packed[:, payload:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    codes = packed[:, :payload]
    if fmt == "int4":
        codes = _unpack_nibbles(codes)[:, :n]
    else:
        codes = codes.view(torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    out = torch.empty(rows, n)
    for a, b, k in _parts(n, block):
        blocks = out[:, a:b].view(rows, -1, k)
        blocks.copy_(codes[:, a:b].reshape(rows, -1, k))
        blocks.mul_(scale[:, a // block : a // block + blocks.shape[1], None])
    return out


def _pack_nibbles(ints: torch.Tensor) -> torch.Tensor:
    """int4 codes (-7..7, an even count per row) -> one byte per pair, offset to 0..15, low nibble first."""
    u = (ints + 8).to(torch.uint8).view(ints.shape[0], -1, 2)
    return u[..., 0] | (u[..., 1] << 4)


def _unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    low, high = (codes & 15).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).view(codes.shape[0], -1)
