"""Checksums of checkpoint files, and the newest checkpoint whose files are all intact.

`index.json` records each file's size and SHA-256 under "files" (the rank files and meta.json), taken from
the bytes on disk after they were written. `verify` recomputes them; `newest_intact` walks back from the
`latest` pointer to the first checkpoint that verifies, each rank hashing its share of the files.
"""

import hashlib
import json
import os
from pathlib import Path

from .common import FORMAT, LATEST, all_gather, rank_world
from .load import outside_problem

__all__ = ["file_record", "verify", "newest_intact"]

_CHUNK = 8 << 20


def file_record(path: Path) -> dict:
    """{"bytes", "sha256"} of a file as it is on disk."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def verify(step_dir: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems with a checkpoint's files (empty: intact). `share=(r, n)` checks every n-th file from the r-th,
    so n ranks check a checkpoint together, each file once. Checkpoints without checksums (older ones) only
    have their files' presence checked."""
    step_dir = Path(step_dir)
    try:
        index = json.loads((step_dir / "index.json").read_text())
        if index.get("format") != FORMAT:
            return [f"index.json has format {index.get('format')!r}, expected {FORMAT!r}"]
        records = index.get("files")
        if records is None:
            records = {s["file"]: None for e in index["tensors"].values() for s in e["shards"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"index.json is unreadable ({type(e).__name__}: {e})"]
    problems = []
    r, n = share
    for name in sorted(records)[r::n]:
        if outside_problem(name):
            problems.append(f"index.json {outside_problem(name)}")
            continue
        path, want = step_dir / name, records[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        if want is None:
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{name} has {size} bytes, the index says {want['bytes']} (truncated or extended)")
        elif file_record(path)["sha256"] != want["sha256"]:
            problems.append(f"{name} does not match its SHA-256 in the index (altered)")
    return problems


def _step(path: Path) -> int:
    return int(path.name[5:]) if path.name.startswith("step-") and path.name[5:].isdigit() else -1


def newest_intact(ckpt_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """(the checkpoint to resume from, [(a newer checkpoint passed over, its problems)]).

    Candidates: the one `latest` points at, then older `step-N` directories, newest first. Collective when a
    process group is up (every rank must call it; all get the same answer). (None, []) when there is no
    `latest` pointer yet; (None, rejected) when no candidate is intact.
    """
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / LATEST
    if not pointer.is_file():
        return None, []
    named = ckpt_dir / pointer.read_text().strip()
    rejected: list[tuple[Path, list[str]]] = []
    if not (named / "index.json").is_file():
        rejected.append((named, [f"'{LATEST}' points at it but it has no index.json (incomplete or deleted)"]))
    newest = _step(named) if _step(named) >= 0 else float("inf")
    older = sorted(
        (p for p in ckpt_dir.glob("step-*") if 0 <= _step(p) < newest and (p / "index.json").is_file()),
        key=_step,
        reverse=True,
    )
    rank, world = rank_world()
    for candidate in ([named] if not rejected else []) + older:
        problems = [p for per_rank in all_gather(verify(candidate, (rank, world))) for p in per_rank]
        if not problems:
            return candidate, rejected
        rejected.append((candidate, problems))
    return None, rejected
