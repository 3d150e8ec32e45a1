"""Do the proofs bite? Each mutation below breaks the code on purpose; the test named with it must then fail.

    PYTHONPATH=$PWD python tests/mutants.py            # every mutation: a table of killed / survived
    PYTHONPATH=$PWD python tests/mutants.py --only heads
    PYTHONPATH=$PWD python tests/mutants.py --check    # only: each old text is still in the tree, once

A mutation is (file, the exact text it replaces, the new text, the test node that must fail). Each is applied
to a fresh copy of the working tree (without .git) in a temporary directory, and the test runs there with
PYTHONPATH set to the copy. Exit status 1 if one survives (its test passed) or its test could not run.
Keep the list as data: when code moves, edit the paths and texts (`--check`, run by tests/test_mutants.py,
says which no longer match).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutant(NamedTuple):
    path: str
    old: str
    new: str
    test: str


MUTANTS = [
    # the bf16 gather writes its rounded values back into the fp32 parameters: the masters are destroyed
    Mutant(
        "spmd/runtime/parameters/group.py",
        "                locals_ = cast_locals(locals_, dtype)\n",
        "                locals_ = cast_locals(locals_, dtype)\n"
        "                for p, low in zip(self.params, locals_):\n"
        "                    p._local_tensor.copy_(low)\n",
        "tests/test_mixed_precision.py::test_bf16_with_fp32_masters_trains_as_the_recipe_on_one_process",
    ),
    # data-only blocks stay eager under compile_blocks: the compiled schedule would compare eager with eager
    Mutant(
        "spmd/runtime/transforms/compile.py",
        "    setattr(block, name, torch.compile(getattr(block, name), **compile_kwargs))\n",
        '    if name != "forward":\n'
        "        setattr(block, name, torch.compile(getattr(block, name), **compile_kwargs))\n",
        "tests/test_compile.py::test_compiled_blocks_gather_what_eager_gathers",
    ),
    # a group of an equal mesh built earlier is named by its number, not by the axes its ranks span
    Mutant(
        "spmd/analysis/record.py",
        "self.group_axes[group_name] = _same_ranks(group_name, mesh_groups) or (str(group_name),)",
        "self.group_axes[group_name] = (str(group_name),)",
        "tests/test_plan_matches_run.py::test_plan_lists_exactly_the_collectives_of_a_real_step",
    ),
    # the per-block path is never taken: both runs of the bit-for-bit comparison take the whole-model path
    Mutant(
        "spmd/runtime/local/whole_model.py",
        "    if state is not None:\n        state.local_members.pop(id(model), None)\n",
        "    return\n",
        "tests/test_local_model.py::test_one_rank_in_bf16_with_accumulation_is_the_per_block_path_bit_for_bit",
    ),
    # heads split by the tp rule no more: each rank holds every head, though the mesh splits them
    Mutant(
        "spmd/layout/rules.py",
        '            "kv_heads": "tp",\n',
        '            "kv_heads": (),\n',
        "tests/test_heads.py::test_heads_that_divide_or_stay_whole_pass",
    ),
    # a traced detach takes the eager shortcut instead of DTensor's dispatch
    Mutant(
        "spmd/runtime/dtensor/detach.py",
        "    if type(x._local_tensor) is not torch.Tensor:",
        "    if False:",
        "tests/test_lean_path.py::test_compiled_blocks_trace_detach_through_dtensor_dispatch",
    ),
    # explain's activation bytes 4% high
    Mutant(
        "spmd/analysis/explain.py",
        "            activations = activation_bytes(saved, model)\n",
        "            activations = activation_bytes(saved, model) * 104 // 100\n",
        "tests/test_spmd_numerics.py::test_spec_matches_one_device_and_its_plan[data_axes]",
    ),
    # the fp32 master copy beside bf16 parameters counted in the parameters' dtype
    Mutant(
        "spmd/analysis/memory.py",
        "        master_size = 4 if separate else p.element_size()\n",
        "        master_size = p.element_size()\n",
        "tests/test_zero_table.py::test_explain_reproduces_zero_paper_table_1_for_64_devices",
    ),
    # fp16's loss scale does not back off after an overflow
    Mutant(
        "launch/nonfinite.py",
        "            self.scale, self.good = max(self.scale / 2, 1.0), 0\n",
        "            self.scale, self.good = max(self.scale, 1.0), 0\n",
        "tests/test_train.py::test_fp16_on_four_processes_skips_an_overflowing_step_on_every_rank",
    ),
    # --compile compiles no block: the trainer runs eager
    Mutant(
        "launch/train.py",
        "    compiled = spmd.compile_blocks(model) if cfg.compile else []\n",
        "    compiled = []\n",
        "tests/test_train.py::test_compiled_blocks_track_eager",
    ),
    # blocks holding float8 layers run on local tensors: each rank scales its activations by its own maxima
    Mutant(
        "spmd/runtime/local/blocks.py",
        "        if computes_in_float8(m):\n",
        "        if False:\n",
        "tests/test_float8.py::test_float8_specs_match_one_process",
    ),
]


def _matches(m: Mutant) -> int:
    path = ROOT / m.path
    return path.read_text().count(m.old) if path.is_file() else 0


def check(mutants=MUTANTS) -> list[str]:
    """The mutations whose old text is not in the tree exactly once, or whose test file or function is gone."""
    problems = []
    for m in mutants:
        if _matches(m) != 1:
            problems.append(f"{m.path}: the text to replace occurs {_matches(m)} times (want 1): {m.old!r}")
        test_file, _, name = m.test.partition("::")
        name = name.split("[")[0]
        if not (ROOT / test_file).is_file() or f"def {name}(" not in (ROOT / test_file).read_text():
            problems.append(f"{m.test}: no such test")
    return problems


def _copy_tree(dest: Path) -> None:
    shutil.copytree(
        ROOT, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.pyc"), symlinks=True
    )


def run(m: Mutant, timeout_s: float) -> str:
    """'killed' when the test fails on the mutated copy, 'SURVIVED' when it passes, else why it did not run."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree(tree)
        target = tree / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            return "STALE (old text not found once)"
        target.write_text(text.replace(m.old, m.new))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", m.test]
        try:
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "killed (timed out)"
        if done.returncode == 1:
            return "killed"
        if done.returncode == 0:
            return "SURVIVED"
        return f"ERROR (pytest exit {done.returncode}: {done.stdout.strip().splitlines()[-1:]})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that each mutation still applies")
    parser.add_argument("--only", default="", help="run the mutations whose file or test contains this")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutated test")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in m.path or args.only in m.test]
    problems = check(chosen)
    if args.check or problems:
        print("\n".join(problems) or f"all {len(chosen)} mutations apply")
        return 1 if problems else 0
    rows = []
    for m in chosen:
        rows.append((run(m, args.timeout), m.path, m.test))
        print(f"{rows[-1][0]:<10} {m.path:<32} {m.test}", flush=True)
    print(
        f"\n{sum(r[0].startswith('killed') for r in rows)} killed, "
        f"{sum(not r[0].startswith('killed') for r in rows)} not killed, of {len(rows)}"
    )
    return 0 if all(r[0].startswith("killed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
