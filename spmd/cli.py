"""What `python -m spmd.explain` and `python -m spmd.search` share: their model flags, how a result is printed and
saved, and the module that is also a function."""
import argparse
import importlib
import json
import sys
import types

from .layout.rules_table import check_rules_flags, read_toml, rules_from_table

__all__ = ["add_model_args", "model_config", "batch_shape", "write_json", "report", "make_callable",
           "parse_args", "config_rules"]

# launch.train's TOML keys -> the flags of explain and search that mean the same
_CONFIG_KEYS = {"model": "model", "mesh": "mesh", "batch_size": "batch", "seq_len": "seq", "dtype": "dtype",
                "ac": "ac", "grad_accum": "grad_accum", "zero": "zero", "master": "master", "offload": "offload",
                "pp_schedule": "pp_schedule", "microbatches": "microbatches", "virtual_stages": "virtual_stages"}


def add_model_args(ap: argparse.ArgumentParser, batch_default: str) -> None:
    ap.add_argument("--model", default="8b", help="PRESET of the registry's default model (Llama: "
                    "tiny|small|1b|8b|70b), MODEL:PRESET, or hf:DIR (a local Hugging Face directory with "
                    "config.json: transformers' own model, built on the meta device)")
    ap.add_argument("--registry", default="models", help="the module whose preset(name) gives model configs")
    ap.add_argument("--batch", type=int, default=None, help=f"global batch in sequences (default: {batch_default})")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    ap.add_argument("--dtype", default="bf16", help="compute dtype: fp32|bf16|fp16")
    ap.add_argument("--json", default="", help="also write the result to this JSON file")
    ap.add_argument("--config", default=None, help="launch.train's TOML file: its model, mesh, batch, dtype, ... "
                    "as defaults (flags override) and its [rules.*] tables as the layout")


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
        ap.set_defaults(**{_CONFIG_KEYS[k]: v for k, v in data.items() if _CONFIG_KEYS.get(k) in dests
                           and (k == "zero" or v not in ("", 0))})
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
        raise ValueError(f"--registry {a.registry!r} cannot be imported ({e}); pass a module with preset(name), "
                         f"such as models") from None
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


def make_callable(module_name: str, fn) -> None:
    """Makes module `module_name` callable as `fn`: importing `spmd.explain` (or `spmd.search`) replaces the
    package's function of that name with the module, and `spmd.explain(model, ...)` must still plan."""
    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
