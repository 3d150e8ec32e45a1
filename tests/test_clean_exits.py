"""Short training scripts exit 0 on every rank.

`test_groups_end_before_the_interpreter`: one launch of 4 processes lays a tiny Llama out on fsdp=2,tp=2,sp,
trains a step, starts an `AsyncSaver` checkpoint and calls `destroy_process_group()` at once: the call returns
with the checkpoint committed (`latest` written), and `spmd.layout.mesh.release_groups` (what runs at exit)
leaves no gloo thread alive in the process, so none is left for the interpreter's finalization to kill in
native code. Mutations that fail it: AsyncSaver not making `destroy_process_group` wait for the save (no
`latest` yet); `release_groups` not clearing the meshes' `_pg_registry` (the groups' worker threads live on).

`test_short_tp_scripts_exit_zero_under_load` (benchmarks.clean_exits): 3 torchrun launches of 4 processes,
one per case, all 3 at once (12 processes on the cores), of a user script that lays the model out on tp=4 (and
tp=4,sp), trains 3 AdamW steps and ends with `destroy_process_group()` twice (each guarded by
`is_initialized()`), one of them with an `AsyncSaver` checkpoint started after the last step and never waited
for. Each launch must exit 0 with every rank's loss written and the checkpoint committed. Mutation that fails
it: AsyncSaver no longer making `destroy_process_group` and the interpreter's exit wait for the save in flight:
the writer, still in a gloo collective as the interpreter finalizes, aborts its rank (SIGABRT) and the
checkpoint is never committed, in every launch, so one launch of each case kills it (a second round of the
three doubled the test's cost, about 65 CPU-seconds, and caught nothing the first did not). The many-launch
count, for a rarer race, is the benchmark's (`python -m benchmarks.clean_exits --launches 30`).
"""

import datetime
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spmd
from benchmarks import clean_exits
from spmd import checkpoint
from spmd.layout.mesh import release_groups
from tests.dist_utils import run_distributed
from tests.spmd_cases import tiny_model


def _gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum("gloo" in (t / "comm").read_text() for t in tasks.iterdir())


def _groups_end(rank, world, ckpt_dir):
    mesh = spmd.make_mesh("fsdp=2,tp=2")
    model = tiny_model()
    spmd.parallelize(model, mesh, spmd.Rules.default(sequence_parallel=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    checkpoint.AsyncSaver().save(ckpt_dir, 1, checkpoint.model_state(model), checkpoint.optim_state(model, opt))
    assert _gloo_threads() > 0
    dist.destroy_process_group()
    assert (Path(ckpt_dir) / "latest").exists(), "destroy_process_group returned before the save in flight ended"
    release_groups()
    assert _gloo_threads() == 0, f"{_gloo_threads()} gloo threads outlive the groups"
    # a group again, for the harness's closing barrier
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank, world_size=world)


@pytest.mark.slow
def test_groups_end_before_the_interpreter():
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_groups_end, 4, tmp, timeout_s=300)


@pytest.mark.slow
def test_short_tp_scripts_exit_zero_under_load():
    rows = clean_exits.run(["bare", "async", "sp"], launches=1, parallel=3, timeout_s=400)
    failed = [{k: r[k] for k in ("case", "rc", "ranks_wrote", "committed", "aborted")} for r in rows if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(rows)} launches did not exit cleanly: {failed}\n" + "\n".join(
        r["output_tail"][-1500:] for r in rows if not r["ok"]
    )
