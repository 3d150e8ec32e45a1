"""spmd: write the model once on the global view, name its axes, pick a mesh, and get DP, FSDP, TP and SP.

    mesh = spmd.make_mesh({"fsdp": 2, "tp": 2})
    rules = spmd.Rules.default(sequence_parallel=True)
    spmd.parallelize(model, mesh, rules)
    plan = spmd.explain(model, rules, {"fsdp": 8, "tp": 8}, batch_shape=(8, 4096))
"""
from .activation_checkpoint import apply_activation_checkpointing
from .annotate import P, annotate, annotate_by_name
from .constrain import constrain
from .explain import explain
from .mesh import MESH_AXES, make_mesh, mesh_sizes, parse_spec
from .parallelize import no_sync, parallelize
from .pipeline import Pipeline, build_pipeline, validate_pipeline
from .pipeline_split import split_stages
from .pipeline_traced import build_traced_pipeline
from .plan import Plan
from .blocks import find_blocks
from .compiled import compile_blocks
from .rules import Rules


def __getattr__(name):  # spmd.search (callable) loads on first use, so `python -m spmd.search` runs cleanly
    if name == "search":
        import importlib
        return importlib.import_module(".search", __name__)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")
