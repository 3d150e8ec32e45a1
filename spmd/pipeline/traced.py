"""Pipeline stages for models without embed/block_inputs/head parts: torch's tracing front end.

`torch.distributed.pipelining.pipeline` traces the model (torch.export) on an example micro-batch and cuts
the graph at the first block of every stage `split_stages` chose, so the cut is cost-balanced as for
spmd's stages. A traced stage is a GraphModule: the module hooks through which spmd.parallelize lays a model
out are gone, so these stages run as plain tensors on a pp-only mesh (no dp/fsdp/tp inside a stage; for
that, spmd.build_pipeline cuts the model's own forward, see spmd/pipeline/cut.py). Parameter names are the model's.
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..runtime.parameters.host import compute_device
from .runtime import PipelineRuntime, default_microbatches, validate_pipeline
from .split import split_stages
from .stage import NamedParams

__all__ = ["build_traced_pipeline"]


class TracedPipeline(PipelineRuntime):
    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0, sync: bool = True
    ) -> torch.Tensor:
        """As Pipeline.step: the mean loss over the batch, the same on every rank."""
        return self._run(inputs, targets, loss_scale, sync)


def build_traced_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: tuple,
    loss_fn,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int = 1,
    split_cost: str = "flops",
    blocks: str | None = None,
) -> TracedPipeline:
    """A pipeline of traced stages on a mesh whose only axis larger than 1 is pp.

    `example_inputs`: the model's positional inputs for one micro-batch (traced once). `loss_fn(output,
    targets)`: the mean loss of a micro-batch from the model's output.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    if "pp" not in mesh.mesh_dim_names:
        raise ValueError(f"build_traced_pipeline needs a mesh with a 'pp' axis, got axes {mesh.mesh_dim_names}")
    others = {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names) if n != "pp" and mesh.size(i) > 1}
    if others:
        raise ValueError(
            f"traced pipeline stages cannot be laid out over {others}: spmd.parallelize works through "
            f"module hooks, which a traced GraphModule no longer has. Use spmd.build_pipeline, which "
            f"cuts {type(model).__name__}'s own forward at its blocks (spmd/pipeline/cut.py)"
        )
    pp = mesh.size(mesh.mesh_dim_names.index("pp"))
    microbatches = microbatches or default_microbatches(schedule, pp)
    split = split_stages(
        model,
        pp * virtual_stages,
        split_cost,
        blocks,
        pp=pp,
        style="v" if schedule == "zbv" else "loop",
        example_inputs=example_inputs,
    )
    validate_pipeline(pp, schedule, microbatches, virtual_stages, split.n_blocks)
    spec = {f"{split.block_path}.{s.blocks[0]}": SplitPoint.BEGINNING for s in split.stages[1:]}
    traced = pipeline(model, mb_args=tuple(example_inputs), split_spec=spec)
    if traced.num_stages != split.n_stages:
        raise ValueError(
            f"tracing {type(model).__name__} gave {traced.num_stages} stages, not {split.n_stages}: "
            f"the blocks in {split.block_path!r} must run in order in its forward"
        )
    rank = mesh.get_local_rank("pp")
    device = compute_device(mesh)
    mine = [s.index for s in split.stages_of_rank(rank)]
    stages = [traced.build_stage(i, device, group=mesh.get_group("pp")) for i in mine]
    named = [(n, p) for st in stages for n, p in st.submod.named_parameters()]
    pipe = TracedPipeline(mesh, split, schedule, microbatches, NamedParams(named))
    pipe._make_schedule(stages, lambda out, target: loss_fn(out, target) * (pipe._scale / pipe.microbatches))
    return pipe
