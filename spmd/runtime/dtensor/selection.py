"""DTensor's choice of an op's strategy, from the few candidates and prices that can decide it.

DTensor expands an op's single-dim strategies over the mesh (1,331 candidates for a matmul on three axes), prices
each candidate's moves of its inputs and, when some candidate moves no input and costs nothing, takes the last
one (`_select_min_cost_strategy`); only otherwise does it compare prices, all of them at least zero. So the
expansion runs first over the rows that keep the inputs' placement on some mesh dim: their product holds every
candidate that moves no input, in torch's order, and when one of them costs nothing the few decide as the whole
would. Prices are worked out when read (`Prices`), and the choice reads only those of candidates that move no
input. Else the full expansion, every price read; also where an op's elements are chosen without its schema
(foreach ops: torch then takes the first cheapest candidate) and where shapes are symbolic (torch's shape guards
see every candidate). tests/test_search_speed.py holds every choice to torch's.
"""

import threading
from collections.abc import Sequence
from itertools import chain

__all__ = ["Prices", "kept_choice"]

_whole = threading.local()  # .on while this thread expands an op whose elements are chosen without its schema


class Prices(Sequence):
    """A candidate's prices of moving one input from each of its current layouts, worked out when first read, for the
    target spec as built: DTensor may set its shard order before it chooses (`_propagate_use_strided_shard_flag`)."""

    __slots__ = ("_price", "_sources", "_target", "_order", "_values")

    def __init__(self, price, sources, target):
        self._price, self._sources, self._target, self._values = price, sources, target, None
        self._order = target.shard_order, target.use_strided_shard_as_shard_order

    def _read(self) -> list:
        if self._values is None:
            target = self._target
            if (target.shard_order, target.use_strided_shard_as_shard_order) != self._order:
                target = _as_built(target, *self._order)
            self._values = [self._price(source.output_spec, target) for source in self._sources]
        return self._values

    def __getitem__(self, i):
        return self._read()[i]

    def __len__(self) -> int:
        return len(self._sources)


def _as_built(spec, shard_order, use_strided_shard_as_shard_order):
    import copy

    built = copy.copy(spec)
    built.__dict__.update(shard_order=shard_order, _hash=None)
    built.__dict__.update(use_strided_shard_as_shard_order=use_strided_shard_as_shard_order)
    return built


def kept_choice(price, torchs: dict) -> dict:
    """torch's `expand_to_full_mesh_op_strategy` (as single-dim and decomposed strategies call it),
    `generate_redistribute_costs` and `_select_min_cost_strategy`, answered from the few that decide."""
    expand, torch_choice = torchs["expansion"], torchs["choice"]
    torch_costs, single_dim = torchs["costs"], torchs["single_dim"]

    def expansion(mesh, op_schema, single_mesh_dim_strategies, **kwargs):
        rows = _rows_keeping_a_dim(mesh, op_schema, single_mesh_dim_strategies, kwargs)
        if rows is not None:
            try:
                few = expand(mesh, op_schema, rows, **kwargs)
            except Exception:  # (an in-place op none of the few suits): the full expansion says what torch says
                few = None
            current = [arg.strategies[0].output_spec for arg in op_schema.args_strategy]
            if few is not None and any(_free(candidate, current) for candidate in few.strategies):
                return few
        return expand(mesh, op_schema, single_mesh_dim_strategies, **kwargs)

    def choice(strategy, op_schema=None):
        candidates = strategy.strategies
        if op_schema is not None and len(candidates) > 1 and all(_priced_lazily(c) for c in candidates):
            last_free = next((c for c in reversed(candidates) if _free(c, op_schema.args_spec)), None)
            if last_free is not None:
                return last_free
        return torch_choice(strategy, op_schema)

    def costs(src_strategy, dst_spec):
        if getattr(_whole, "on", False) or not _concrete([dst_spec, *(s.output_spec for s in src_strategy.strategies)]):
            return torch_costs(src_strategy, dst_spec)
        return Prices(price, src_strategy.strategies, dst_spec)

    return {"expansion": expansion, "choice": choice, "costs": costs, "single_dim": _whole_for_foreach(single_dim)}


def _whole_for_foreach(single_dim):
    """torch's `_expand_single_dim_strategy_to_mesh`, each element of a foreach op expanded and priced whole: torch
    chooses it without the op's schema (the first cheapest candidate, which may move an input at no cost)."""
    from torch.distributed.tensor._op_schema import TupleStrategy

    def expansion(mesh, op_schema, strategy_info, output_tensor_meta):
        expanded = single_dim(mesh, op_schema, strategy_info, output_tensor_meta)
        if not any(isinstance(arg, TupleStrategy) for arg in op_schema.args_schema):
            return expanded

        def whole(*args, **kwargs):
            outer, _whole.on = getattr(_whole, "on", False), True
            try:
                return expanded(*args, **kwargs)
            finally:
                _whole.on = outer

        return whole

    return expansion


def _rows_keeping_a_dim(mesh, op_schema, rows, kwargs):
    """The single-dim rows whose positional inputs keep their current placement on some mesh dim, or None where
    that does not narrow the expansion, or cannot (a foreach op, an input of several strategies or of a symbolic
    shape, inputs on other meshes, rows that differ in which entries are not tensors)."""
    inputs = op_schema.args_strategy + op_schema.kwargs_strategy
    if getattr(_whole, "on", False) or kwargs.get("different_mesh_args"):
        return None
    if any(len(arg.strategies) != 1 for arg in inputs):
        return None
    if not _concrete([arg.strategies[0].output_spec for arg in inputs]):
        return None
    if len({tuple(p is None for p in row) for row in rows}) != 1:
        return None
    current = [arg.strategies[0].output_spec.placements for arg in op_schema.args_strategy]
    first_input = kwargs.get("input_index", 1)

    def keeps(row, dim) -> bool:
        placed = [p for p in row[first_input:] if p is not None]
        return all(p == now[dim] for p, now in zip(placed, current))

    narrowed = [row for row in rows if any(keeps(row, dim) for dim in range(mesh.ndim))]
    return narrowed if len(narrowed) < len(rows) else None


def _concrete(specs) -> bool:
    """Whether every spec has a shape of plain ints (symbolic sizes: torch's guards must see every candidate)."""
    return all(s.tensor_meta is not None and all(type(n) is int for n in s.tensor_meta.shape) for s in specs)


def _priced_lazily(candidate) -> bool:
    """Whether every price of the candidate is a `Prices` row (none below zero); an op's own strategy may set others."""
    rows = candidate.redistribute_cost
    return rows is not None and all(type(row) is Prices for row in rows)


def _free(candidate, current) -> bool:
    """torch's test of a candidate that moves no positional input (`current`: their specs) and costs nothing."""
    wanted = candidate.input_specs if candidate.input_specs is not None else [candidate.output_spec] * len(current)
    moves = any(now.placements != spec.placements for now, spec in zip(current, wanted))
    return not moves and sum(chain.from_iterable(candidate.redistribute_cost)) == 0
