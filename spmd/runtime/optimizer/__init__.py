"""The optimizer step on the optimizer map's shards (shard), fp32 masters and their updated shards gathered back
into the parameters (masters), and optimizer state offloaded to host memory or files (offload, transfer)."""

__all__: list[str] = []
