"""explain's peak memory per rank against the live tensor bytes of a real training step.

One launch of four gloo processes runs, for each spec in turn, the tiny Llama in fp32 under
benchmarks.tensor_memory's LiveTensorBytes (every op's output storage counted once while it lives): the model
is laid out, AdamW takes a first step (so its moments exist), and the peak of the second step (forward,
backward, AdamW step) is held against `plan.memory["peak"]`, explain's figure for the same spec made on a
fake world (spmd.analysis.memory.peak_bytes), within TOL. The peak falls at the end of backward, as the
gradient reducer packs its reduce-scatter buffer. Measured: explain within 0.1% of the real peak (fsdp=4
-0.06%). Mutations killed: leaving the reducer's chunk copies out of peak_bytes (fsdp=4 16% under); holding them
through the reduce-scatter, as the packing did when it kept them (fsdp=2,tp=2,sp 11.5% over); counting the
unreduced gradients once instead of twice fails too.
"""

import pytest
import torch

import spmd
from benchmarks.tensor_memory import LiveTensorBytes
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, local_slice, plan_for, tiny_model

TOL = 0.10
SPECS = ["fsdp=4", "fsdp=2,tp=2,sp", "dp=2,fsdp=2"]


def _measured_peak(spec: str) -> int:
    """Peak live tensor bytes of this rank in the second AdamW step of the tiny model laid out by `spec`."""
    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    live = LiveTensorBytes()
    with live:
        model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default(sequence_parallel="sp" in flags))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            tokens, targets = global_batch(step)
            inputs = local_slice(tokens, mesh), local_slice(targets, mesh)
            live.peak = live.now  # the step's own peak, on top of what lives between steps
            model(*inputs).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return live.peak


def _compare(rank, world, planned: dict):
    for spec, want in planned.items():
        got = _measured_peak(spec)
        err = (want - got) / got
        if rank == 0:
            print(f"rank {rank} {spec}: peak measured {got:,} B, explain {want:,} B, error {err:+.1%}", flush=True)
        assert abs(err) <= TOL, f"{spec} rank {rank}: measured peak {got:,} B, explain says {want:,} B ({err:.1%})"


@pytest.mark.slow
def test_explain_predicts_the_peak_of_a_real_step():
    planned = {spec: plan_for(spec).memory["peak"] for spec in SPECS}
    run_distributed(_compare, 4, planned, timeout_s=300)
