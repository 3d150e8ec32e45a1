"""spmd: write the model once on the global view, name its axes, pick a mesh, and get DP, FSDP, TP and SP.

    mesh = spmd.make_mesh({"fsdp": 2, "tp": 2})
    rules = spmd.Rules.default(sequence_parallel=True)
    spmd.parallelize(model, mesh, rules)
    plan = spmd.explain(model, rules, {"fsdp": 8, "tp": 8}, batch_shape=(8, 4096))

Four rooms that import downward only: `layout` (mesh, rules, annotations), `runtime` (the pass),
`pipeline` (stages and schedules), `analysis` (explain, search); plus `checkpoint`.
"""

from .analysis.explain import explain
from .analysis.plan import Plan
from .float8 import float8_training
from .layout.annotate import P, annotate, annotate_by_name
from .layout.blocks import find_blocks
from .layout.mesh import MESH_AXES, make_mesh, mesh_sizes, parse_spec
from .layout.presets import annotate_hf
from .layout.rules import Rules
from .layout.sequence import cp_slice, zigzag_positions
from .optim import Muon, OneBitAdam
from .pipeline import Pipeline, build_pipeline, build_traced_pipeline, split_stages, validate_pipeline
from .runtime.activations.moves import constrain
from .runtime.optimizer.shard import reduce_gradients, shard_optimizer
from .runtime.parallelize import no_sync, parallelize
from .runtime.transforms.checkpointing import apply_activation_checkpointing
from .runtime.transforms.compile import compile_blocks

__all__ = [
    "explain",
    "Plan",
    "float8_training",
    "P",
    "annotate",
    "annotate_by_name",
    "find_blocks",
    "MESH_AXES",
    "make_mesh",
    "mesh_sizes",
    "parse_spec",
    "annotate_hf",
    "Rules",
    "cp_slice",
    "zigzag_positions",
    "Pipeline",
    "build_pipeline",
    "build_traced_pipeline",
    "split_stages",
    "validate_pipeline",
    "constrain",
    "apply_activation_checkpointing",
    "compile_blocks",
    "no_sync",
    "parallelize",
    "reduce_gradients",
    "shard_optimizer",
    "search",
    "Muon",
    "OneBitAdam",
]


def __getattr__(name):  # spmd.search (spmd.analysis.search's function) loads on first use
    if name == "search":
        from .analysis.search import search

        return search
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")


def _warn_if_untested_torch(tested=(2, 13)):
    import warnings

    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < tested:
        need = ".".join(map(str, tested))
        warnings.warn(
            f"spmd is tested on torch >= {need}; this is torch {torch.__version__}, whose DTensor and "
            f"checkpoint internals differ: one-process training, compiled blocks and offload run, other "
            f"paths may fail. Upgrade: pip install 'torch>={need}'",
            stacklevel=3,
        )


_warn_if_untested_torch()
