"""Context parallelism: attention on a sequence split over the cp axis, by ring (ring)."""

__all__: list[str] = []
