"""The compute dtypes by the names flags, configs and plans use: fp32, bf16, fp16."""

import torch

__all__ = ["DTYPES", "as_dtype", "dtype_name"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


def as_dtype(dtype) -> torch.dtype:
    """A torch dtype from a name ("bf16", "bfloat16", "torch.bfloat16") or a dtype (returned as it is)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not one of {tuple(DTYPES)} (or a torch dtype)")
    return found


def dtype_name(dtype) -> str:
    """ "bf16" from torch.bfloat16, "bfloat16" or "bf16"."""
    if isinstance(dtype, torch.dtype):
        return _NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return _NAMES.get(getattr(torch, str(dtype), None), str(dtype))
