"""Test-only entry point: launch.train with a fault installed (tests/fault_injection.py).

    python tests/fault_train.py [--fault RANK:STEP:KIND] [--nan-steps 3,4] [--kill-after-files N] FLAGS...
    torchrun ... tests/fault_train.py --fault 1:5:kill FLAGS...

FLAGS go to launch.train unchanged; every rank installs the same fault, which fires where it names.
"""

import argparse

import fault_injection

import launch.train
from spmd.layout.mesh import exit_process

parser = argparse.ArgumentParser()
parser.add_argument("--fault", help="RANK:STEP:exit|kill|hang")
parser.add_argument("--nan-steps", default="")
parser.add_argument("--kill-after-files", type=int)
args, flags = parser.parse_known_args()
if args.fault:
    rank, step, kind = args.fault.split(":")
    fault_injection.before_step(setattr, int(rank), int(step), kind)
if args.nan_steps:
    fault_injection.nan_steps(setattr, {int(s) for s in args.nan_steps.split(",")})
if args.kill_after_files:
    fault_injection.kill_after_files(setattr, args.kill_after_files)
exit_process(launch.train.main(flags))  # as launch.train's own __main__ ends
