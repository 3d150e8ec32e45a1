"""Parameters: storage layout (storage), the one parameter-group type for every move (group), a model's groups
(buckets), each module's moves before it runs (gather), between forward and backward (reshard), uses outside
their module (outside_use), and shards kept in host memory (host).
"""

__all__: list[str] = []
