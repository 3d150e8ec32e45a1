"""Transforms of a laid-out model: activation checkpointing (checkpointing) and compilation of its blocks (compile)."""

__all__: list[str] = []
