"""What a layout is, as data: the mesh and its axes, the rules from logical axes to mesh axes, and the
annotations that name a model's tensor axes. Nothing here runs a model or a collective."""

from .annotate import P, annotate, annotate_by_name, fake_copy
from .blocks import find_blocks
from .mesh import MESH_AXES, make_mesh, mesh_sizes, parse_spec
from .rules import Rules
from .sequence import cp_slice, zigzag_positions

__all__ = [
    "P",
    "annotate",
    "annotate_by_name",
    "fake_copy",
    "find_blocks",
    "MESH_AXES",
    "make_mesh",
    "mesh_sizes",
    "parse_spec",
    "Rules",
    "cp_slice",
    "zigzag_positions",
]
