"""What `python -m spmd.explain` and `python -m spmd.search` share: their model flags, how a result is printed and
saved, and the module that is also a function."""
import argparse
import importlib
import json
import sys
import types

__all__ = ["add_model_args", "model_config", "batch_shape", "write_json", "report", "make_callable"]


def add_model_args(ap: argparse.ArgumentParser, batch_default: str) -> None:
    ap.add_argument("--model", default="8b", help="PRESET of the registry's default model (Llama: "
                    "tiny|small|1b|8b|70b), MODEL:PRESET, or hf:DIR (a local Hugging Face directory with "
                    "config.json: transformers' own model, built on the meta device)")
    ap.add_argument("--registry", default="models", help="the module whose preset(name) gives model configs")
    ap.add_argument("--batch", type=int, default=None, help=f"global batch in sequences (default: {batch_default})")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    ap.add_argument("--dtype", default="bf16", help="compute dtype: fp32|bf16|fp16")
    ap.add_argument("--json", default="", help="also write the result to this JSON file")


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
