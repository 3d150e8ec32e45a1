"""Every committed benchmark result says which commit made it (with a clean tree) and names no machine's paths."""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
MACHINE_PATH = re.compile(r"(?<![\w.])/(root|home|work|tmp|Users)/")


def _known_commit(commit: str) -> bool:
    try:
        return (
            subprocess.run(
                ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
            ).returncode
            == 0
        )
    except OSError:  # no git: the commit's shape was checked already
        return True


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_result_names_its_commit(path):
    env = json.loads(path.read_text()).get("environment", {})
    commit = env.get("commit", "")
    assert re.fullmatch(r"[0-9a-f]{40}", commit), f"{path.name}: environment.commit is {commit!r}"
    assert env.get("dirty") is False, f"{path.name} was made with uncommitted code changes"
    assert _known_commit(commit), f"{path.name}: commit {commit} is not in this repository's history"


@pytest.mark.parametrize(
    "path",
    RESULTS + sorted(p.with_suffix(".md") for p in RESULTS if p.with_suffix(".md").exists()),
    ids=lambda p: p.name,
)
def test_result_names_no_machine_path(path):
    found = MACHINE_PATH.search(path.read_text())
    assert found is None, (
        f"{path.name} holds a machine path near {path.read_text()[found.start() : found.start() + 60]!r}"
    )


def test_there_are_results():
    assert RESULTS, "benchmarks/results holds no results"


def test_a_commit_named_from_outside_must_be_whole(monkeypatch):
    """A device machine's copy has no git directory of its own: `SPMD_COMMIT` names the commit, in full, or
    the benchmark writes no results (results naming a short hash would fail the checks above)."""
    from benchmarks import common

    monkeypatch.setenv("SPMD_COMMIT", "53dd53d")
    with pytest.raises(ValueError, match="full 40-character hash"):
        common.environment()
    monkeypatch.setenv("SPMD_COMMIT", "a" * 40)
    assert common.environment()["commit"] == "a" * 40
