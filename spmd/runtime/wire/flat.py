"""The flat collectives in a quantized wire format (spmd.runtime.collectives hands them over): a parameter
all-gather (qwZ: packed codes + scales gathered, each row dequantized to the buffer's dtype); a gradient
reduce-scatter (qgZ: the row bound for each rank quantized, one all-to-all, the n rows dequantized and summed
in fp32, never in the low-precision type); a gradient all-reduce (that reduce-scatter over equal cuts, then
an all-gather of the summed cuts in the same format, as DeepSpeed's compressed all-reduce's server side).
Each is finished when its value is read (`wait`); its recorder reason gains "<format> on the wire".
"""

import contextlib

import torch
import torch.distributed._functional_collectives as funcol

from .. import tags
from .quantize import dequantize, quantize

__all__ = ["Pending", "gather", "reduce_scatter", "all_reduce", "ON_THE_WIRE", "all_gather_single", "waited", "tagged"]

ON_THE_WIRE = "on the wire"

all_gather_single = funcol.all_gather_single  # (spmd.runtime.collectives gathers through it too)


def waited(t):
    """The value of a functional collective (a plain tensor passes through)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def tagged(fmt: str):
    """The caller's reason, naming the wire format."""
    now = tags.current_reason()
    if now is None:
        return contextlib.nullcontext()
    module, why, origin = now
    return tags.reason(module, f"{why}; {fmt} {ON_THE_WIRE}", origin)


class Pending:
    """An issued quantized collective: `wait()` finishes it (dequantizes, sums) once and gives the value."""

    def __init__(self, out, finish):
        self.out, self.finish, self.value = out, finish, None

    def wait(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.finish(waited(self.out))
        return self.value


def gather(buffer: torch.Tensor, fmt: str, block: int, group, n: int) -> Pending:
    """Every rank's flat `buffer` over `group` (n ranks), back to back, in the buffer's dtype."""
    length, dtype = buffer.numel(), buffer.dtype
    packed = quantize(buffer.reshape(1, -1), fmt, block).view(-1)
    with tagged(fmt):
        out = all_gather_single(packed, 0, group)
    return Pending(out, lambda got: dequantize(got.view(n, -1), length, fmt, block).to(dtype).reshape(-1))


def reduce_scatter(rows: torch.Tensor, fmt: str, block: int, group) -> Pending:
    """rows (n, seg), row r bound for rank r of `group`: the fp32 sum of those bound here, in the rows' dtype."""
    n, seg = rows.shape
    packed = quantize(rows, fmt, block)
    with tagged(fmt):
        out = funcol.all_to_all_single(packed.reshape(-1), None, None, group)
    return Pending(out, lambda got: _sum_rows(dequantize(got.view(n, -1), seg, fmt, block)).to(rows.dtype))


def _sum_rows(values: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of the rows in rank order (fixed: an all-reduce requantizes it, a last bit can move a code)."""
    total = values[0].clone()
    for row in values[1:]:
        total += row
    return total


def all_reduce(flat: torch.Tensor, fmt: str, block: int, group, n: int) -> torch.Tensor:
    """The sum of every rank's `flat` over `group`: a quantized reduce-scatter of n equal cuts (the last
    padded), then an all-gather of the summed cuts in the same format."""
    length = flat.numel()
    cut = -(-length // n)
    rows = torch.nn.functional.pad(flat.reshape(-1), (0, n * cut - length)).view(n, cut)
    mine = reduce_scatter(rows, fmt, block, group).wait()
    return gather(mine, fmt, block, group, n).wait()[:length]
