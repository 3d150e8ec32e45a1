"""Wire precision (ZeRO++): the block-wise quantizers, the `comm` setting of spmd.parallelize (`Wire`,
validated before anything moves), the quantized flat collectives spmd.runtime.collectives routes to (flat),
hpZ's secondary parameter shards (hpz) and the per-parameter path's quantized gather (param).
"""

from .quantize import DEFAULT_BLOCK, FORMATS, INT4_BLOCK, dequantize, packed_bytes, quantize
from .setting import Wire, wire_setting

__all__ = ["DEFAULT_BLOCK", "INT4_BLOCK", "FORMATS", "quantize", "dequantize", "packed_bytes", "Wire", "wire_setting"]
