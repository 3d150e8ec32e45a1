"""Ranks that lay a model out together must agree on how: the same mesh, rules, dtypes and parameters.

Otherwise they would issue different collectives and hang, or train on garbage. `check_layout_agrees` all-gathers
an 8-byte digest per field (the same size on every rank, so it cannot hang) and raises on every rank, naming the
fields that differ, before any collective of the layout.
"""

import hashlib

import torch
import torch.distributed as dist

__all__ = ["check_layout_agrees"]


def check_layout_agrees(model, mesh, rules, layouts: dict, **settings) -> None:
    """`parallelize`'s agreement: mesh, rules, settings, and each parameter's name, shape, dtype and layouts. A
    no-op alone, in a fake world (explain), or on a mesh that covers only some of the ranks (a pipeline stage:
    stages hold different parameters)."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    world = dist.get_world_size()
    if world == 1 or mesh.size() != world:
        return
    fields = {  # name -> a text every rank must have equal
        "mesh": f"{dict(zip(mesh.mesh_dim_names, mesh.shape))} on {mesh.device_type}",
        "rules": _rules_summary(rules),
        "settings": ", ".join(f"{k}={v}" for k, v in sorted(settings.items())),
        "parameters": repr([(n, tuple(p.shape), p.dtype, layouts[n]) for n, p in model.named_parameters()]),
    }
    names = sorted(fields)
    digest = b"".join(hashlib.sha256(fields[n].encode()).digest()[:8] for n in names)
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(mesh.device_type)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    chunks = [t.cpu().view(len(names), 8) for t in every]
    differ = {r: [n for i, n in enumerate(names) if not torch.equal(c[i], chunks[0][i])] for r, c in enumerate(chunks)}
    differ = {r: d for r, d in differ.items() if d}
    if differ:
        where = "; ".join(f"rank {r}: {', '.join(d)}" for r, d in differ.items())
        shown = [n for n in sorted({n for d in differ.values() for n in d}) if len(fields[n]) <= 600]
        mine_now = "".join(f"; {n} here (rank {dist.get_rank()}): {fields[n]}" for n in shown)
        raise ValueError(
            f"spmd.parallelize: ranks disagree with rank 0 on {where}{mine_now}. "
            f"Start every rank with the same mesh, rules, dtypes and model"
        )


def _rules_summary(rules) -> str:
    """The compute map and what each later map adds to the one before: short enough to show in the error."""
    parts, before = [f"compute {sorted(rules.compute.items())}"], rules.compute
    for which in ("params", "grads", "optimizer"):
        now = getattr(rules, which)
        added = sorted((k, v) for k, v in now.items() if before.get(k) != v)
        if added:
            parts.append(f"{which} adds {added}")
        before = now
    return "; ".join(parts)
