"""Test-only entry point giving ranks different arguments: `torchrun ... tests/rank_args.py FLAGS` runs
launch.train with FLAGS plus, on rank R, the flags in $SPMD_TEST_RANK<R>_ARGS; $SPMD_TEST_RANK<R>_CODE_VERSION
replaces that rank's code version (as if it ran other sources)."""

import os
import runpy
import shlex
import sys

import launch.startup

rank = os.environ["RANK"]
code = os.environ.get(f"SPMD_TEST_RANK{rank}_CODE_VERSION")
if code:
    launch.startup.code_version = lambda: code
sys.argv = ["launch.train", *sys.argv[1:], *shlex.split(os.environ.get(f"SPMD_TEST_RANK{rank}_ARGS", ""))]
runpy.run_module("launch.train", run_name="__main__", alter_sys=True)
