"""Wire precision: the format a state travels in over a collective, as part of its layout (ZeRO++).

Owns the block-wise quantizers (int8 and float8 e4m3 parameter payloads, int8 and int4 gradient payloads,
one fp32 scale per block), the `comm` setting of spmd.parallelize (`Wire`, validated before anything moves),
and the quantized forms of the flat collectives: a parameter all-gather that sends payload + scales and
dequantizes after, and qgZ's gradient reduce-scatter by all-to-all, dequantized and summed in fp32.
spmd.runtime.collectives routes its flat collectives here when handed a wire format.
"""

from .quantize import DEFAULT_BLOCK, FORMATS, dequantize, packed_bytes, quantize
from .setting import Wire, wire_setting

__all__ = ["DEFAULT_BLOCK", "FORMATS", "quantize", "dequantize", "packed_bytes", "Wire", "wire_setting"]
