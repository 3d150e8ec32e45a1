"""launch.train's failure behaviour on 4 ranks, in one launch (tests/dist_utils.run_distributed): ranks started
with different configs, a NaN on one rank's micro-batch, a streak of them, and a damaged shard of the 4-rank
checkpoint. Each rank runs the trainer's own entry (`launch.train.main`) and checks what it returns and prints.
"""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from dist_utils import run_distributed
from torch.distributed.tensor.debug import CommDebugMode

from tests.test_train import SMALL
from tests.train_ranks import main_on_rank as _main

pytestmark = pytest.mark.usefixtures("isolated_trainer")

COLLECTIVES = (
    "all_gather_object",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "gather",
    "scatter",
    "reduce",
    "gather_object",
    "scatter_object_list",
    "monitored_barrier",
    "batch_isend_irecv",
)


@contextlib.contextmanager
def _calls_logged():
    """The outermost torch.distributed collective calls made inside, by name, in order."""
    calls, depth, saved = [], [0], {}

    def wrap(name, fn):
        def logged(*args, **kwargs):
            if depth[0] == 0:
                calls.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return logged

    for name in COLLECTIVES:
        saved[name] = getattr(c10d, name)
        for module in (c10d, dist):
            setattr(module, name, wrap(name, saved[name]))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            for module in (c10d, dist):
                setattr(module, name, fn)


def _tensors(step_dir) -> dict:
    from spmd import checkpoint

    return {k: checkpoint.read_full(step_dir, k) for k in checkpoint.tensor_names(step_dir)}


def _differing(a, b) -> list[str]:
    """The tensors of two checkpoints that differ (all of them when their names differ)."""
    ta, tb = _tensors(a), _tensors(b)
    return sorted(ta.keys() ^ tb.keys()) or [k for k in ta if not ta[k].equal(tb[k])]


def _differing_configs_fail_before_any_collective(rank, base):
    """Rank 1 gets another --lr, rank 3 another --seed. Every rank fails with exit 2 naming both fields, and
    the only collective it made is the agreement's one all_gather_object (no DTensor or training collective).
    Mutation killed: a dist.barrier() put before the agreement in launch/train.py (calls: barrier first)."""
    extra = {1: ["--lr", "1e-3"], 3: ["--seed", "1"]}.get(rank, [])
    with _calls_logged() as calls, CommDebugMode() as comm:
        code, err = _main([*base, "--steps", "1", *extra])
    assert code == 2, err[-2000:]
    assert f"launch.train [rank {rank}]: error: the 4 ranks were started with different configs" in err
    assert "  - lr: 0.003 on ranks 0,2,3, 0.001 on rank 1\n" in err, err
    assert "  - seed: 0 on ranks 0,1,2, 1 on rank 3\n" in err, err
    assert calls == ["all_gather_object"], calls
    assert set(map(str, comm.get_comm_counts())) <= {"c10d.allgather_"}, comm.get_comm_counts()


def _one_rank_nan_and_a_streak(rank, base, ck, metrics):
    """Rank 2's first micro-batch (of 2) is NaN in steps 3, 5, 6 and 7; --max-bad-steps 3. Every rank skips
    step 3 (every rank's shards after it equal those before it, the step counted as bad), step 4 trains, and
    steps 5..7 stop every rank with exit 4 and step-7 saved holding step 4's state.
    Mutation killed: launch/train.py deciding the skip from the loss alone (`bad.check(step + 1, loss_value,
    0.0)`): the loss is this rank's own, so rank 2 skips while the others step, and the test fails."""
    import fault_injection

    fault_injection.nan_steps(setattr, {3, 5, 6, 7}, rank=2, micro=0)
    code, err = _main(
        [
            *base,
            "--steps",
            "10",
            "--grad-accum",
            "2",
            "--max-bad-steps",
            "3",
            "--ckpt-dir",
            ck,
            "--ckpt-every",
            "1",
            "--ckpt-keep",
            "0",
            "--metrics",
            metrics,
        ]
    )
    assert code == 4, err[-2000:]
    assert f"[rank {rank}]: error: steps 5..7 had a non-finite loss or gradient norm (3 in a row" in err
    dist.barrier()
    if rank == 0:
        ck = Path(ck)
        rows = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
        assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 2, 3, 4]
        pairs = ((3, 2), (4, 3), (7, 4))
        skipped, stepped, stopped = (_differing(ck / f"step-{a}", ck / f"step-{b}") for a, b in pairs)
        assert skipped == [] and stepped and stopped == [], (skipped, stepped[:3], stopped)
        assert (ck / "latest").read_text().strip() == "step-7"
        from spmd import checkpoint

        assert checkpoint.read_meta(ck)["bad_steps"] == {"skipped": 4, "streak": 3, "last_good": 4}
    dist.barrier()


def _a_damaged_shard_falls_back_on_every_rank(rank, base, ck):
    """Rank 2's file of step-7 has a flipped byte: every rank (each hashing a share of the files, then
    gathering) rejects step-7 and resumes step-6.
    Mutation killed: newest_intact without its all_gather (each rank judging only its share of the files):
    the ranks that did not hash rank 2's file pick step-7."""
    from launch.config import load_config
    from launch.setup import resume_point

    if rank == 0:
        f = Path(ck, "step-7", "rank-00002.safetensors")
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    dist.barrier()
    cfg = load_config([*base, "--steps", "8", "--ckpt-dir", ck, "--resume"])
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert resume_point(cfg, rank) == Path(ck, "step-6")
    if rank == 0:
        assert "rank-00002.safetensors does not match its SHA-256 in the index (altered)" in err.getvalue()
        assert f"falling back to {Path(ck, 'step-6')}" in err.getvalue()


def _four_rank_faults(rank, world, tmp):
    base = [*SMALL, "--mesh", "fsdp=4"]
    _differing_configs_fail_before_any_collective(rank, base)
    _one_rank_nan_and_a_streak(rank, base, f"{tmp}/ck", f"{tmp}/m.jsonl")
    _a_damaged_shard_falls_back_on_every_rank(rank, base, f"{tmp}/ck")


@pytest.mark.slow
def test_faults_on_four_ranks(tmp_path):
    run_distributed(_four_rank_faults, 4, str(tmp_path), timeout_s=400)
