"""The propagation pass at run time: module hooks that move parameters (params, buckets, reshard) and
activations (activations) into the layouts the rules give, plus activation checkpointing and compilation
of the blocks it lays out."""

from .activations.moves import constrain
from .parallelize import no_sync, parallelize
from .transforms.checkpointing import apply_activation_checkpointing
from .transforms.compile import compile_blocks

__all__ = ["constrain", "apply_activation_checkpointing", "compile_blocks", "no_sync", "parallelize"]
