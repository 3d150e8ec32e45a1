"""Parameters: their storage layout (storage); the parameter group, one type for every way they move (group: a
block's, the root unit's, one parameter's; it unshards them to the compute layout, regathers them for backward and
reduces their gradients); which groups a model has (buckets); which move each module's parameters take before it
runs (gather); what happens to them between forward and backward (reshard); the parameters used outside their own
module (outside_use); and parameter shards kept in host memory (host)."""

__all__: list[str] = []
