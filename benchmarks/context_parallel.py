"""Context parallelism: activation memory per rank and ring traffic as cp grows, measured next to planned.

    python -m benchmarks.context_parallel [--model small] [--seq 1024] [--cp 1 2 4] [--nproc 4]

Each cp runs on `--nproc` gloo processes, the rest of the world as fsdp (cp=1: `fsdp=4`, cp=2: `fsdp=2,cp=2`,
cp=4: `cp=4`), with a global batch of one sequence per fsdp rank, so every rank works on one sequence of
seq/cp tokens. Measured in one real step (one torchrun launch for every cp): the bytes autograd keeps for
backward per rank (less the parameters it saves; ZeRO-3's gathered weights are regathered, not kept),
attention's part of them, the peak bytes one attention call holds while it runs (what it allocates:
under cp the ring's K/V blocks in flight and each block's scores; spmd.runtime.activations.attention_memory), and the
bytes the ring sends per rank. Planned: `spmd.explain` for the same mesh and batch on a fake world. The
ring's formula: per layer, (cp-1) hops of the rank's K and V block (2 · seq/cp · kv_heads · head_dim
elements), backward twice that. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import spmd
from benchmarks import common
from models.llama import Llama, LlamaConfig


def ring_formula(cfg: LlamaConfig, batch: int, seq: int, cp: int, element: int = 4) -> int:
    return cfg.n_layers * (cp - 1) * 2 * batch * (seq // cp) * cfg.n_kv_heads * cfg.head_dim * element


def spec_for(cp: int, nproc: int) -> dict:
    """The mesh of `nproc` ranks with this cp, the rest fsdp."""
    return {k: v for k, v in (("fsdp", nproc // cp), ("cp", cp)) if v > 1} or {"fsdp": 1}


def ring_sends(records) -> dict:
    return {
        ph: sum(c.bytes for c in records if c.kind == "send" and c.phase == ph and "ring" in c.reason)
        for ph in ("forward", "backward")
    }


def planned(cfg: LlamaConfig, sizes: dict, seq: int) -> dict:
    plan = spmd.explain(Llama(cfg), spmd.Rules.default(), sizes, batch_shape=(sizes.get("fsdp", 1), seq))
    return {
        "activations": plan.memory["activations"],
        "attention": plan.attention["saved"],
        "peak": plan.attention["peak"],
        **ring_sends(plan.collectives),
    }


def worker(args: dict) -> None:
    """One real forward and backward per cp on this rank; writes its figures to args["out"]/rank{r}.json."""
    import torch
    import torch.distributed as dist

    from spmd.analysis.memory import activation_bytes
    from spmd.analysis.record import CollectiveRecorder
    from spmd.runtime.activations import attention_memory
    from spmd.runtime.parameters.reshard import observe_saved

    rank, cfg, seq, out = int(os.environ["RANK"]), LlamaConfig.preset(args["model"], kernels="torch"), args["seq"], []
    for sizes in args["meshes"]:
        mesh = spmd.make_mesh(sizes)
        torch.manual_seed(0)
        rules = spmd.Rules.default()
        model = spmd.parallelize(Llama(cfg), mesh, rules)
        tokens = torch.randint(
            0, cfg.vocab_size, (rules.data_parallel_size(mesh), seq + 1), generator=torch.Generator().manual_seed(1)
        )
        row = tokens[rules.data_parallel_rank(mesh)][None]
        x, y, pos = (spmd.cp_slice(t, mesh) for t in (row[:, :-1], row[:, 1:], torch.arange(seq)[None]))
        recorder, saved, attention = CollectiveRecorder(mesh), {}, {}
        dist.barrier()
        with recorder, attention_memory.observe(attention):
            with observe_saved(saved):
                loss = model(x.contiguous(), y.contiguous(), pos.contiguous())
            loss.backward()
        out.append(
            {
                "activations": activation_bytes(saved, model),
                "peak": attention["peak"],
                "attention": sum(attention["saved"].values()),
                **ring_sends(recorder.records),
            }
        )
        del model, loss
        dist.barrier()
    Path(args["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(out))


def measure(model: str, meshes: list[dict], seq: int, nproc: int) -> list[dict]:
    """Per mesh, the largest figure over the ranks (every rank holds the same share, so they agree)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = {"model": model, "meshes": meshes, "seq": seq, "out": tmp}
        common.run(common.torchrun(nproc) + ["-m", "benchmarks.context_parallel", "--worker", json.dumps(args)])
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)]
    return [{k: max(r[i][k] for r in ranks) for k in ranks[0][i]} for i in range(len(meshes))]


def table(
    cfg: LlamaConfig, cps: list[int], meshes: list[dict], measured: list[dict], plans: list[dict], seq: int
) -> list[str]:
    def mib(n):
        return f"{n / 2**20:,.2f}"

    base, att = measured[0]["activations"], measured[0]["attention"]
    lines = [
        "| cp | mesh | activations MiB measured / planned | vs cp=1 | attention saved MiB measured / planned "
        "| vs cp=1 | attention peak MiB measured / planned | ring sent fwd B measured / planned / formula "
        "| bwd B measured |",
        "|---" * 9 + "|",
    ]
    for cp, sizes, m, p in zip(cps, meshes, measured, plans):
        mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
        lines.append(
            f"| {cp} | {mesh} | {mib(m['activations'])} / {mib(p['activations'])} | "
            f"{m['activations'] / base:.3f} | {mib(m['attention'])} / {mib(p['attention'])} | "
            f"{m['attention'] / att:.3f} | {mib(m['peak'])} / {mib(p['peak'])} | {m['forward']:,} / "
            f"{p['forward']:,} / {ring_formula(cfg, 1, seq, cp):,} | {m['backward']:,} |"
        )
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--nproc", type=int, default=4)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    cfg = LlamaConfig.preset(a.model, kernels="torch")
    meshes = [spec_for(cp, a.nproc) for cp in a.cp]
    measured = measure(a.model, meshes, a.seq, a.nproc)
    plans = [planned(cfg, sizes, a.seq) for sizes in meshes]
    print(
        f"{a.model}, one sequence of {a.seq} tokens per fsdp rank, fp32, bytes per rank per step "
        f"({a.nproc} gloo processes; planned by spmd.explain)"
    )
    print("\n".join(table(cfg, a.cp, meshes, measured, plans, a.seq)))


if __name__ == "__main__":
    main()
