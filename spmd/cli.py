"""The commands `python -m spmd.explain` and `python -m spmd.search` (`explain_main`, and
spmd.search_command.search_main): their model flags, how a result is printed and saved. The package's
`spmd.explain` and `spmd.search` are the functions (spmd.analysis); the command modules are scripts that run
these."""

import argparse
import importlib
import json
import sys

import torch

from .analysis.explain import explain
from .float8 import float8_training
from .layout.mesh import parse_spec
from .layout.rules import Rules
from .layout.rules_table import check_rules_flags, read_toml, rules_from_table

__all__ = [
    "add_model_args",
    "model_config",
    "batch_shape",
    "write_json",
    "report",
    "parse_args",
    "config_rules",
    "explain_parser",
    "plan_from_args",
    "explain_main",
    "run_command",
]

# launch.train's TOML keys -> the flags of explain and search that mean the same
_CONFIG_KEYS = {
    "model": "model",
    "mesh": "mesh",
    "batch_size": "batch",
    "seq_len": "seq",
    "dtype": "dtype",
    "ac": "ac",
    "grad_accum": "grad_accum",
    "zero": "zero",
    "master": "master",
    "offload": "offload",
    "optimizer": "optimizer",
    "pp_schedule": "pp_schedule",
    "microbatches": "microbatches",
    "virtual_stages": "virtual_stages",
}


def add_model_args(ap: argparse.ArgumentParser, batch_default: str) -> None:
    ap.add_argument(
        "--model",
        default="8b",
        help="PRESET of the registry's default model (Llama: "
        "tiny|small|1b|8b|70b), MODEL:PRESET, or hf:DIR (a local Hugging Face directory with "
        "config.json: transformers' own model, built on the meta device)",
    )
    ap.add_argument("--registry", default="models", help="the module whose preset(name) gives model configs")
    ap.add_argument("--batch", type=int, default=None, help=f"global batch in sequences (default: {batch_default})")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    ap.add_argument("--dtype", default="bf16", help="compute dtype: fp32|bf16|fp16")
    ap.add_argument("--json", default="", help="also write the result to this JSON file")
    ap.add_argument(
        "--config",
        default=None,
        help="launch.train's TOML file: its model, mesh, batch, dtype, ... "
        "as defaults (flags override) and its [rules.*] tables as the layout",
    )


def parse_args(ap: argparse.ArgumentParser, argv, prog: str) -> argparse.Namespace | None:
    """The parsed flags, over the values of `--config FILE` (launch.train's keys, the trainer's "" and 0 meaning
    "not set"); None after printing the error when the file cannot be read."""
    known, _ = ap.parse_known_args(argv)
    if known.config is not None:
        try:
            data = read_toml(known.config)
        except ValueError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return None
        dests = {a.dest for a in ap._actions}
        ap.set_defaults(
            **{
                _CONFIG_KEYS[k]: v
                for k, v in data.items()
                if _CONFIG_KEYS.get(k) in dests and (k == "zero" or v not in ("", 0))
            }
        )
    return ap.parse_args(argv)


def config_rules(a: argparse.Namespace, sequence_parallel: bool | None):
    """The `Rules` of `--config FILE`'s [rules.*] tables, or None without them; `--zero` or `,sp` saying
    otherwise is an error naming both."""
    if a.config is None:
        return None
    table = read_toml(a.config).get("rules")
    if table is None:
        return None
    source = f"config file {a.config}"
    rules = rules_from_table(table, source)
    check_rules_flags(rules, source, getattr(a, "zero", None), sequence_parallel)
    return rules


def model_config(a: argparse.Namespace):
    """The config of `--model` from the `--registry` module (spmd names models, it never imports them)."""
    try:
        registry = importlib.import_module(a.registry)
    except ImportError as e:
        raise ValueError(
            f"--registry {a.registry!r} cannot be imported ({e}); pass a module with preset(name), such as models"
        ) from None
    return registry.preset(a.model)


def batch_shape(a: argparse.Namespace, cfg, default_batch: int) -> tuple[int, int]:
    return a.batch or default_batch, a.seq or min(cfg.max_seq_len, 4096)


def write_json(path: str, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def report(prog: str, path: str, produce) -> int:
    """Prints `produce()`'s table and writes its dict to `path` (if given): status 0. Bad input (a ValueError)
    is one line on stderr: status 2."""
    try:
        result = produce()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(result.table())
    write_json(path, result.to_dict())
    return 0


def explain_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m spmd.explain",
        description="Prints the plan of one training "
        "step (collectives, layout decisions, memory per rank) of a registry model on a "
        "mesh of any size, without devices.",
    )
    ap.add_argument("--mesh", default="fsdp=8,tp=8,sp", help="mesh spec, e.g. fsdp=8,tp=8,sp or pp=2,fsdp=4,tp=8")
    add_model_args(ap, batch_default="the mesh's size")
    ap.add_argument("--ac", default="none", help="activation checkpointing: none|full|selective:N")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--pp-schedule", default="1f1b", help="with a pp axis: gpipe|1f1b|interleaved-1f1b|zero-bubble|zbv")
    ap.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default: the schedule's)")
    ap.add_argument("--virtual-stages", type=int, default=1, help="pipeline stages per pp rank")
    ap.add_argument(
        "--zero",
        type=int,
        default=None,
        help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 + "
        "parameters sharded over fsdp (Rules.default(zero=...); default 3)",
    )
    ap.add_argument("--master", default="params", help="params|optimizer: where fp32 master weights live")
    ap.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw|muon: muon adds spmd.Muon's exchanges of whole matrices to the step (launch.train's --optimizer)",
    )
    ap.add_argument("--reduce-dtype", default="fp32", help="gradient reduction dtype: fp32|bf16")
    ap.add_argument("--float8", action="store_true", help="linear layers in float8 (spmd.float8_training; torchao)")
    ap.add_argument(
        "--offload",
        default=None,
        help="optimizer|params|nvme:DIR: optimizer states (params: stage-3 parameter shards too) off the device",
    )
    return ap


def plan_from_args(a: argparse.Namespace):
    sizes, flags = parse_spec(a.mesh)
    cfg = model_config(a)
    with torch.device("meta"):
        model = cfg.build()
    if a.float8:
        float8_training(model, emulate=True)
    world = 1
    for s in sizes.values():
        world *= s
    rules = config_rules(a, True if "sp" in flags else None)
    if rules is None:
        rules = Rules.default(sequence_parallel="sp" in flags, zero=3 if a.zero is None else a.zero)
    return explain(
        model,
        rules,
        sizes,
        batch_shape(a, cfg, world),
        a.dtype,
        a.optimizer,
        ac=a.ac,
        grad_accum=a.grad_accum,
        schedule=a.pp_schedule,
        microbatches=a.microbatches,
        virtual_stages=a.virtual_stages,
        reduce_dtype=a.reduce_dtype,
        master=a.master,
        offload=a.offload,
    )


def explain_main(argv=None) -> int:
    a = parse_args(explain_parser(), argv, "spmd.explain")
    if a is None:
        return 2
    return report("spmd.explain", a.json, lambda: plan_from_args(a))


def run_command(module_name: str, main) -> None:
    """The body of a command module (spmd/explain.py, spmd/search.py): runs `main` as `python -m module_name`.
    Imported instead, the module would take the place of the package's function of the same name. A process
    that multiprocessing spawns (the search's workers) runs the module again as `__mp_main__`: nothing to do."""
    if module_name == "__mp_main__":
        return
    if module_name != "__main__":
        raise ImportError(
            f"spmd.{main.__name__.split('_')[0]} is a command (python -m); its code is "
            f"{main.__module__}.{main.__name__}, and the function of that name is the package's"
        )
    raise SystemExit(main())
