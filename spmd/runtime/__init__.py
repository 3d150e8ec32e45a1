"""The propagation pass at run time: module hooks that move parameters and activations into the layouts the rules
give, in rooms by concern (see each subpackage).
"""

from .activations.moves import constrain
from .parallelize import no_sync, parallelize
from .transforms.checkpointing import apply_activation_checkpointing
from .transforms.compile import compile_blocks

__all__ = ["constrain", "apply_activation_checkpointing", "compile_blocks", "no_sync", "parallelize"]
