"""Execution on local tensors, where nothing moves: data-only blocks (blocks), the whole model on a mesh of one
rank (whole_model), the edges between the two worlds (edges), and which modules carry the pass's hooks (hook_sets)."""

__all__: list[str] = []
