"""Test-session settings that must hold before any test module is imported."""

import os

import pytest

# Triton reads TRITON_INTERPRET when it is first imported, and torch imports it early (CommDebugMode does), so
# the Triton kernels' CPU tests need it set here, before collection imports anything.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def isolated_trainer(tmp_path_factory, monkeypatch):
    """launch.train in-process: its caches under the test's temp dir, a fixed peak (no GEMM probe), and no
    torchrun rank variables leaking in from the environment."""
    import launch.train as T

    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "spmd-cache"))
    monkeypatch.setattr(T, "peak_flops", lambda dtype, device: (1e11, "test"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
