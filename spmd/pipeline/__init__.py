"""Pipeline parallelism over the `pp` mesh axis: split a model into stages (split), build the stages spmd
lays out (stage: a model's embed/block_inputs/head parts; cut: any model's own forward cut at its blocks;
build) or traced ones (traced), and run torch's schedules over them (runtime)."""

from .build import Pipeline, build_pipeline
from .runtime import INTERLEAVED, SCHEDULES, PipelineRuntime, bubble_fraction, default_microbatches, validate_pipeline
from .split import split_stages
from .traced import build_traced_pipeline

__all__ = [
    "Pipeline",
    "build_pipeline",
    "build_traced_pipeline",
    "split_stages",
    "SCHEDULES",
    "INTERLEAVED",
    "PipelineRuntime",
    "bubble_fraction",
    "default_microbatches",
    "validate_pipeline",
]
