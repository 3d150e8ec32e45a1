"""The command `python -m spmd.search` (`search_main`): its flags, and the rules a `--config` file pins for the
search. The model flags, printing and saving are the commands' shared ones (spmd.cli)."""

import argparse
import os
import sys

from .cli import add_model_args, batch_shape, config_rules, model_config, parse_args, report
from .layout.rules import Rules
from .layout.rules_table import ordered_maps

__all__ = ["search_main"]


def search_main(argv=None) -> int:
    from .analysis.search import search
    from .analysis.search_pipeline import Pipeline
    from .analysis.search_pool import stop_on_term

    ap = argparse.ArgumentParser(
        prog="python -m spmd.search",
        description=sys.modules["spmd.analysis.search"].__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--world", type=int, default=64, help="number of devices")
    ap.add_argument("--device", default="h100", help="h100|h200|a100|cpu")
    add_model_args(ap, batch_default="world")
    ap.add_argument("--budget-gib", type=float, default=None, help="memory budget per rank (default 90%% of device)")
    ap.add_argument(
        "--ac",
        default=None,
        help="assume this activation checkpointing (none|full|selective:N) instead of the least that fits",
    )
    ap.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="assume this many micro-batches per step instead of the fewest that fit",
    )
    ap.add_argument(
        "--zero",
        type=int,
        default=None,
        help="assume this ZeRO stage (1|2|3) on meshes with an fsdp axis instead of trying each",
    )
    ap.add_argument("--max-pp", type=int, default=1, help="also try pipelines of up to this many stages")
    ap.add_argument("--pp-schedule", default="1f1b", help="the pipelines' schedule (launch.train's --pp-schedule)")
    ap.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="pipeline micro-batches per step (0: the schedule's default, pp or 2 pp)",
    )
    ap.add_argument("--top", type=int, default=None)
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8), help="planning processes")
    a = parse_args(ap, argv, "spmd.search")
    if a is None:
        return 2
    stop_on_term()

    def ranked():
        cfg = model_config(a)
        zero, sp = _pinned_by_rules(a)
        return search(
            cfg,
            a.world,
            a.device,
            None if a.budget_gib is None else a.budget_gib * 2**30,
            batch_shape(a, cfg, a.world),
            a.dtype,
            a.top,
            workers=a.workers,
            ac=a.ac,
            grad_accum=a.grad_accum,
            zero=zero,
            sequence_parallel=sp,
            progress=True,
            max_pp=a.max_pp,
            pipeline=Pipeline(a.pp_schedule, a.microbatches),
        )

    return report("spmd.search", a.json, ranked)


def _pinned_by_rules(a):
    """(zero, sequence_parallel) for `search`: `--config`'s [rules.*] tables pin both where they are a default
    table; the search tries meshes under Rules.default only, so another table is an error naming the fix."""
    rules = config_rules(a, None)
    if rules is None:
        return a.zero, (False, True)
    if ordered_maps(rules) != ordered_maps(Rules.default(rules.sequence_parallel, rules.zero_stage)):
        raise ValueError(
            f"config file {a.config}: spmd.search ranks meshes under Rules.default's tables; plan "
            f"these [rules.*] tables on a mesh with `python -m spmd.explain --config {a.config} --mesh "
            f"SPEC`, or state a default table (docs/layouts-and-rules.md)"
        )
    return rules.zero_stage, (rules.sequence_parallel,)
