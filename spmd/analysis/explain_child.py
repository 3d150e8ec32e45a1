"""`python -m spmd.analysis.explain_child JOB OUT`: runs one `explain` dry run in a fresh interpreter (used when the
calling process already belongs to a real process group) and writes the plan as JSON."""

import json
import sys

import torch

from spmd.analysis.explain import dry_run

__all__: list[str] = []  # run as a program

if __name__ == "__main__":
    model, rules, sizes, batch_shape, dtype, optimizer, *pipeline = torch.load(sys.argv[1], weights_only=False)
    plan = dry_run(model, rules, sizes, batch_shape, dtype, optimizer, *pipeline)
    with open(sys.argv[2], "w") as f:
        json.dump(plan.to_dict(), f)
