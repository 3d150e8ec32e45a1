"""Prints `spmd.explain`'s plan (its table, every collective, memory per rank) for a fixed set of specs, on fake
worlds: the numerics specs, activation checkpointing, ZeRO 1/2/3, offload, pipeline, context and expert parallel.
A change to the runtime that must not change behaviour leaves this output identical:

    python -m benchmarks.plan_diff > /tmp/plan_before.txt   # on the old tree
    python -m benchmarks.plan_diff > /tmp/plan_after.txt    # on the new tree
    diff /tmp/plan_before.txt /tmp/plan_after.txt
"""

import argparse

import torch

import models
import spmd
from models.llama import Llama, LlamaConfig

__all__ = ["CASES", "main"]

BATCH, SEQ = 8, 16
NUMERICS = ["dp=4", "fsdp=4", "dp=2,fsdp=2", "tp=4", "tp=4,sp", "fsdp=2,tp=2", "fsdp=2,tp=2,sp"]


def _llama(n_layers=None):
    torch.manual_seed(0)
    extra = {} if n_layers is None else {"n_layers": n_layers}
    return Llama(LlamaConfig.preset("tiny", kernels="torch", **extra))


def _moe():
    torch.manual_seed(0)
    return models.preset("moe-tiny", kernels="torch").build()


def _case(spec, model=_llama, zero=None, **kwargs):
    sizes, flags = spmd.parse_spec(spec)
    rules = spmd.Rules.default(sequence_parallel="sp" in flags, **({} if zero is None else {"zero": zero}))
    return lambda: spmd.explain(model(), rules, sizes, batch_shape=(BATCH, SEQ), **kwargs)


CASES = {
    **{spec: _case(spec) for spec in NUMERICS},
    **{f"{spec} ac=full": _case(spec, ac="full") for spec in ("fsdp=4", "tp=4,sp", "fsdp=2,tp=2,sp")},
    **{f"fsdp=4 zero={z}": _case("fsdp=4", zero=z) for z in (1, 2, 3)},
    "dp=2,fsdp=2 zero=1 bf16": _case("dp=2,fsdp=2", zero=1, dtype=torch.bfloat16),
    "fsdp=4 offload=optimizer": _case("fsdp=4", offload="optimizer"),
    "fsdp=4 grad_accum=2": _case("fsdp=4", grad_accum=2),
    **{
        f"pp=2,{s} zero={z}": _case(f"pp=2,{s}", model=lambda: _llama(4), zero=z)
        for s, z in (("fsdp=2", 3), ("fsdp=2", 1), ("tp=2,sp", 2))
    },
    "pp=4 interleaved": _case("pp=4", model=lambda: _llama(8), schedule="interleaved-1f1b", virtual_stages=2),
    "fsdp=2,cp=2": _case("fsdp=2,cp=2"),
    "cp=4": _case("cp=4"),
    "tp=2,cp=2,sp": _case("tp=2,cp=2,sp"),
    "fsdp=2,ep=2": _case("fsdp=2,ep=2", model=_moe),
    "ep=4": _case("ep=4", model=_moe),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    a = ap.parse_args(argv)
    for name, make in CASES.items():
        if a.only not in name:
            continue
        print(f"==== {name}")
        try:
            plan = make()
        except Exception as e:  # a case that cannot plan prints its error, which must not change either
            print(f"error: {type(e).__name__}: {e}")
            continue
        print(plan.table())
        for c in plan.collectives:
            print(" ", c.phase, c.module, c.kind, c.axes, c.bytes, c.reason, c.origin)
        print("  memory", sorted(plan.memory.items()))


if __name__ == "__main__":
    main()
