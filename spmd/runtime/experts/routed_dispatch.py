"""Expert parallelism for self-routing expert modules (transformers'): `forward(hidden_states [N, H], top_k_index
[N, k], top_k_weights [N, k])`. Under `experts -> ep` each (token, choice) pair goes to its expert's rank by
all-to-all, the module computes one choice per row with `num_experts` set to its E/ep local experts, and the rows
come back to be summed per token. Backward mirrors each all-to-all; `explain` takes the routing to be balanced.
"""

import inspect

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from ...layout.annotate import get_axes
from ...layout.mesh import mesh_sizes
from .all_to_all import AllToAll, balanced_counts, exchange_counts

__all__ = ["RoutedDispatch"]


class RoutedDispatch:
    """The hooks that send a self-routing expert module's (token, choice) pairs to their experts' ranks."""

    def __init__(self, state, name: str, module: nn.Module):
        self.name = name
        self.experts = next(p.shape[0] for p in module.parameters(recurse=False) if "experts" in (get_axes(p) or ()))
        self.per_rank = self.experts // mesh_sizes(state.mesh)["ep"]  # the experts each rank holds
        self.group = state.mesh.get_group("ep")
        self.signature = inspect.signature(module.forward)
        self.pending: list = []

    def enter(self, module, args, kwargs):
        x, index, weights = self.signature.bind(*args, **kwargs).args[:3]
        n, k = index.shape
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)  # the pairs grouped by expert, so by the rank holding it
        balanced = is_fake(flat)  # explain: no data, so the plan takes the routing to be balanced
        counts = balanced_counts(n * k, self.experts) if balanced else torch.bincount(flat, minlength=self.experts)
        _, send, recv, note = exchange_counts(counts, balanced, self.group, self.name, "pairs")
        rows, row_weights, local = (  # each pair's row, its weight and its expert among the rank's own
            AllToAll.apply(
                t, recv, send, self.group, self.name, "dispatch each (token, choice) to its expert's rank" + note
            )
            for t in (
                x[order // k],
                weights.reshape(-1)[order].unsqueeze(1),
                (flat[order] % self.per_rank).unsqueeze(1),
            )
        )
        self.pending.append((order // k, n, send, recv, note, module.__dict__.get("num_experts")))
        module.__dict__["num_experts"] = self.per_rank  # the module's own routing: its local experts
        return (rows, local, row_weights), {}

    def leave(self, module, args, output):
        token, n, send, recv, note, experts = self.pending.pop()
        del module.__dict__["num_experts"]
        if experts is not None:  # (else not an attribute of the module's own: a class's, or none)
            module.__dict__["num_experts"] = experts
        if output.shape[0] == 0:
            # no pair came: tie inputs and experts to the output so this rank's backward still runs the reverse
            # exchanges with the others', its experts taking a (zero) gradient
            rows, _, row_weights = args
            output = output + 0 * (
                rows.sum()
                + row_weights.sum()
                + sum(
                    module.__dict__[n].sum() for n, _ in module.named_parameters(recurse=False) if n in module.__dict__
                )
            )
        rows = AllToAll.apply(
            output, send, recv, self.group, self.name, "combine expert outputs on their tokens' ranks" + note
        )
        return torch.zeros(n, rows.shape[1], dtype=rows.dtype, device=rows.device).index_add(0, token, rows)
