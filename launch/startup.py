"""Starting a multi-process run: the process group with a bounded collective timeout, then one check that
every rank was started with the same config and the same code.

    start_process_group(timeout_s, device)   # before any other collective
    agree(cfg, model_cfg)                    # every rank: ValueError naming the fields that differ

A rank that dies or stops responding makes every collective that waits on it fail after `timeout_s` at the
latest (gloo reports a dead peer's closed connection sooner), so no rank waits forever.

The code version is a SHA-256 of the Python sources of the packages a run executes (spmd, launch, models,
kernels), not the git commit: it is known without git and changes with uncommitted edits too.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_PACKAGES = ("spmd", "launch", "models", "kernels")
_VERSIONS = {"code_version", "torch_version"}


def start_process_group(timeout_s: float, device: torch.device) -> None:
    """The default process group from torchrun's environment, every collective bounded by `timeout_s`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # the mesh's sub-groups (DeviceMesh, pipeline) take these module defaults, not the default group's timeout
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    # torchrun keeps its store across restarts: without a prefix per attempt, a restarted group reads the
    # dead workers' addresses from the previous attempt and cannot connect
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 serves the store
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
        multi_tenant=not agent,
    )
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"spmd/attempt-{attempt}", store), rank=rank, world_size=world, timeout=timeout
    )


def code_version() -> str:
    """SHA-256 (first 16 hex digits) of every .py file of the packages a run executes, by relative path."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        module = __import__(package)
        root = Path(module.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            h.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def fingerprint(cfg, model_cfg=None) -> dict:
    """What every rank must have in common: each config field, the resolved model config (`model.<field>`),
    the code version and the torch version."""
    model = {f"model.{k}": v for k, v in (model_cfg.to_dict() if model_cfg is not None else {}).items()}
    return {**cfg.to_dict(), **model, "code_version": code_version(), "torch_version": torch.__version__}


def differences(per_rank: list[dict]) -> dict[str, list]:
    """field -> the value on each rank, for the fields whose values are not all equal."""
    keys = sorted(set().union(*per_rank))
    out = {}
    for key in keys:
        values = [d.get(key, "<missing>") for d in per_rank]
        if any(v != values[0] for v in values[1:]):
            out[key] = values
    return out


def describe(diff: dict[str, list]) -> str:
    lines = []
    for key, values in diff.items():
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(repr(v), []).append(r)
        lines.append(
            f"{key}: " + ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}" for v, rs in groups.items())
        )
    return "\n  - ".join(lines)


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, rs)) if len(rs) <= 8 else f"{rs[0]}..{rs[-1]} ({len(rs)} ranks)"


def agree(cfg, model_cfg=None) -> str:
    """Collective: every rank gathers every rank's fingerprint and raises the same ValueError when they differ.
    Returns the run's config hash."""
    mine = fingerprint(cfg, model_cfg)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    diff = differences(everyone)
    if diff:
        fixes = []
        if set(diff) - _VERSIONS:
            fixes.append("start every rank with the same flags and config file")
        if set(diff) & _VERSIONS:
            fixes.append("install the same code (spmd, launch, models, kernels) and torch on every node")
        raise ValueError(
            f"the {len(everyone)} ranks were started with different configs, so none of them "
            f"trains:\n  - {describe(diff)}\nfix: {'; '.join(fixes)}"
        )
    return hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest()[:16]
