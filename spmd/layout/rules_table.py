"""Rules stated as data: the `[rules.compute]`, `[rules.params]`, `[rules.grads]` and `[rules.optimizer]`
tables of a TOML file (MaxText's logical axis rules), each logical axis -> a mesh axis or a list of them.

    [rules.compute]
    batch = ["dp", "fsdp", "ep"]
    mlp = "tp"
    [rules.params]
    embed = "fsdp"

`compute` is required; `params`, `grads` and `optimizer` add sharding to the map before them, as `Rules`'
arguments do (an empty list replicates). `launch.train --config`, `python -m spmd.explain --config` and
`python -m spmd.search --config` read the same file.
"""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .rules import Rules

__all__ = ["MAPS", "rules_from_table", "read_toml", "check_rules_flags", "ordered_maps"]

MAPS = ("compute", "params", "grads", "optimizer")


def _check_map(which: str, table, source: str) -> dict:
    where = f"{source}: [rules.{which}]"
    if not isinstance(table, dict):
        raise ValueError(
            f"{where} is a {type(table).__name__}; make it a table of logical axis = mesh axis, "
            f'e.g. [rules.{which}] with mlp = "tp"'
        )
    for axis, value in table.items():
        ok = isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)
        if not ok:
            raise ValueError(
                f"{where} {axis} = {value!r}: a rule is a mesh axis or a list of them; write "
                f'{axis} = "tp", {axis} = ["dp", "fsdp"] or {axis} = [] (not sharded)'
            )
    return table


def rules_from_table(table, source: str = "rules") -> Rules:
    """`Rules` from a `rules` table (the four maps); bad tables are a ValueError naming the key and the fix."""
    if not isinstance(table, dict):
        raise ValueError(f"{source}: rules = {table!r} must be tables: [rules.compute], [rules.params], ...")
    unknown = [k for k in table if k not in MAPS]
    if unknown:
        raise ValueError(
            f"{source}: [rules.{unknown[0]}] is not a map of the rules; use {', '.join(f'[rules.{m}]' for m in MAPS)}"
        )
    if "compute" not in table:
        raise ValueError(
            f"{source}: a rules table needs [rules.compute] (the layout of activations and of the "
            f'parameters in use), e.g. batch = ["dp", "fsdp"] and mlp = "tp"'
        )
    maps = {which: _check_map(which, table[which], source) for which in MAPS if which in table}
    try:
        return Rules(**maps)
    except ValueError as e:
        raise ValueError(f"{source}: [rules] {e}") from None


def ordered_maps(rules: Rules) -> tuple:
    """The four maps with their order (the earlier rule keeps a mesh axis two dims of an activation claim):
    two Rules lay out alike exactly when these are equal."""
    return tuple(tuple(getattr(rules, which).items()) for which in MAPS)


def read_toml(path: str | Path) -> dict:
    """The TOML file at `path` as a dict; a missing or malformed file is a ValueError saying so."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"config file {str(path)!r} does not exist; pass a TOML file such as launch/configs/tiny_rules.toml"
        )
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None


def check_rules_flags(rules: Rules, source: str, zero: int | None, sequence_parallel: bool | None) -> None:
    """A rules table decides the ZeRO stage and sequence parallelism; a flag that says otherwise is an error
    (None: the flag was not given)."""
    if zero is not None and zero != rules.zero_stage:
        raise ValueError(
            f"{source}: its [rules] tables make ZeRO stage {rules.zero_stage} but --zero {zero} was "
            f"given; leave --zero out (the tables decide which states shard) or change the tables"
        )
    if sequence_parallel is not None and sequence_parallel != rules.sequence_parallel:
        said = "asks for" if sequence_parallel else "turns off"
        has = "maps seq to tp" if rules.sequence_parallel else "does not map seq to tp"
        raise ValueError(
            f"{source}: sequence parallelism is in the [rules.compute] table (it {has}), but a flag "
            f"{said} it (--sp or ',sp' in --mesh); drop the flag or change seq in [rules.compute]"
        )
