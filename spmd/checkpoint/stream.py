"""A safetensors file written tensor by tensor, in bounded pieces: a memory-mapped (nvme-offloaded) tensor is
read a piece at a time and its pages go back to its file after each, so a rank's state larger than host
memory still saves. The format is safetensors' own (an 8-byte little-endian header length, the JSON header of
names, dtypes, shapes and byte offsets plus `__metadata__`, padded with spaces to 8 bytes, then the bytes), so
`safetensors.safe_open` and `load_file` read it."""

import json
import struct

import torch

from ..runtime.optimizer.offload import file_backed, release_pages

__all__ = ["save_file", "PIECE_BYTES"]

PIECE_BYTES = 64 * 2**20  # read and written at a time

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Writes contiguous CPU `tensors` to `path` as safetensors; file-backed ones piece by piece, their pages
    released after each piece."""
    header, at = {}, 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"checkpoint tensor {name}: {t.dtype} on {t.device} (contiguous: {t.is_contiguous()}) "
                f"cannot be written; pass contiguous CPU tensors of {sorted(map(str, _DTYPES))}"
            )
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            _write_bytes(f, t)


def _write_bytes(f, t: torch.Tensor) -> None:
    if not t.numel():
        return
    flat = t.reshape(-1).view(torch.uint8)
    mapped = file_backed(t)
    piece = PIECE_BYTES if mapped else flat.numel()
    for start in range(0, flat.numel(), piece):
        f.write(memoryview(flat[start : start + piece].numpy()))
        if mapped:
            release_pages([t])
