"""The propagation pass at run time: module hooks that move parameters (params, buckets, reshard) and
activations (activations) into the layouts the rules give, plus activation checkpointing and compilation
of the blocks it lays out."""
from .activations import constrain
from .checkpointing import apply_activation_checkpointing
from .compile import compile_blocks
from .parallelize import no_sync, parallelize

__all__ = ["constrain", "apply_activation_checkpointing", "compile_blocks", "no_sync", "parallelize"]
