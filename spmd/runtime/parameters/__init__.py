"""Parameters: their storage layout (storage), how they reach the compute layout before use, one by one or a block at
a time (gather, buckets), what happens to them between forward and backward (reshard), the parameters used outside
their own module (outside_use), and parameter shards kept in host memory (host)."""

__all__: list[str] = []
