"""launch.train's `main` on each rank of a tests/dist_utils launch: the trainer as torchrun runs it, without
starting fresh interpreters (a torchrun launch of 4 imports torch and spmd 4 times, about 12 CPU seconds on
this machine, where a fork from dist_utils' server costs none). Real torchrun launches stay where the launcher
itself is under test (restarts, signals, clean exits, the README's job).
"""

import contextlib
import io

import torch.distributed as dist

from tests.dist_utils import run_distributed


def main_on_rank(argv) -> tuple[int, str]:
    """launch.train.main on this rank, its stderr; the launch's process group outlives it."""
    import launch.train as T

    err, destroy = io.StringIO(), dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None
    try:
        with contextlib.redirect_stderr(err):
            code = T.main(argv)
    finally:
        dist.destroy_process_group = destroy
    return code, err.getvalue()


def _each(rank, world, argvs):
    for argv in argvs:
        code, err = main_on_rank(argv)
        assert code == 0, f"launch.train {' '.join(argv)} exited {code}: {err[-3000:]}"


def train_on_ranks(world: int, *argvs, timeout_s: float = 400.0) -> None:
    """launch.train with each of `argvs` in turn on `world` processes of one launch; each must exit 0."""
    run_distributed(_each, world, [list(a) for a in argvs], timeout_s=timeout_s)
