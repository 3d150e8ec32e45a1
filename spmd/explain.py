"""`spmd.explain`: the plan of one training step (spmd.analysis.explain), callable as
`spmd.explain(model, rules, {"fsdp": 8, "tp": 8}, batch_shape=(8, 4096))`, and its command line:

    python -m spmd.explain --model 8b --mesh fsdp=8,tp=8,sp --batch 8 --seq 4096 --dtype bf16 [--ac full]
                           [--grad-accum 2] [--json FILE] [--zero 1|2|3] [--master params|optimizer]
                           [--reduce-dtype fp32|bf16] [--offload optimizer|params|nvme:DIR]
    python -m spmd.explain --config launch/configs/tiny_rules.toml [flags]   # the trainer's file and its rules

prints `plan.table()` of a registry model (meta tensors, no devices) laid out by the default rules of ZeRO
stage `--zero`, or by the [rules.*] tables of `--config FILE`; `--model hf:DIR` plans the transformers model
of a local Hugging Face directory (config.json is enough).
"""
import argparse

import torch

from .analysis.explain import explain
from .cli import add_model_args, batch_shape, config_rules, parse_args, make_callable, model_config, report
from .layout.mesh import parse_spec
from .layout.rules import Rules

__all__ = ["explain", "main", "parser", "plan_from_args"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m spmd.explain", description="Prints the plan of one training "
                                 "step (collectives, layout decisions, memory per rank) of a registry model on a "
                                 "mesh of any size, without devices.")
    ap.add_argument("--mesh", default="fsdp=8,tp=8,sp", help="mesh spec, e.g. fsdp=8,tp=8,sp or pp=2,fsdp=4,tp=8")
    add_model_args(ap, batch_default="the mesh's size")
    ap.add_argument("--ac", default="none", help="activation checkpointing: none|full|selective:N")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--pp-schedule", default="1f1b", help="with a pp axis: gpipe|1f1b|interleaved-1f1b|zero-bubble|zbv")
    ap.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default: the schedule's)")
    ap.add_argument("--virtual-stages", type=int, default=1, help="pipeline stages per pp rank")
    ap.add_argument("--zero", type=int, default=None, help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 + "
                    "parameters sharded over fsdp (Rules.default(zero=...); default 3)")
    ap.add_argument("--master", default="params", help="params|optimizer: where fp32 master weights live")
    ap.add_argument("--reduce-dtype", default="fp32", help="gradient reduction dtype: fp32|bf16")
    ap.add_argument("--offload", default=None,
                    help="optimizer|params|nvme:DIR: optimizer states (params: stage-3 parameter shards too) off the device")
    return ap


def plan_from_args(a: argparse.Namespace):
    sizes, flags = parse_spec(a.mesh)
    cfg = model_config(a)
    with torch.device("meta"):
        model = cfg.build()
    world = 1
    for s in sizes.values():
        world *= s
    rules = config_rules(a, True if "sp" in flags else None)
    if rules is None:
        rules = Rules.default(sequence_parallel="sp" in flags, zero=3 if a.zero is None else a.zero)
    return explain(model, rules, sizes,
                   batch_shape(a, cfg, world), a.dtype, ac=a.ac, grad_accum=a.grad_accum, schedule=a.pp_schedule,
                   microbatches=a.microbatches, virtual_stages=a.virtual_stages, reduce_dtype=a.reduce_dtype,
                   master=a.master, offload=a.offload)


def main(argv=None) -> int:
    a = parse_args(parser(), argv, "spmd.explain")
    if a is None:
        return 2
    return report("spmd.explain", a.json, lambda: plan_from_args(a))


if __name__ == "__main__":
    raise SystemExit(main())
else:
    make_callable(__name__, explain)
