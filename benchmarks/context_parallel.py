"""Context parallelism on a fake world: activation bytes per rank and ring traffic as cp grows.

    python -m benchmarks.context_parallel [--model small] [--seq 1024] [--batch 1] [--cp 1 2 4]

For each cp, `spmd.explain` lays the model out on a fake world of `cp=N` and runs one step on fake tensors:
the bytes autograd keeps for backward per rank (every layer works on seq/cp tokens, attention included,
so they fall as 1/cp) and the bytes the ring attention sends per rank, forward and backward, next to the
formula: per layer, (cp-1) hops of the rank's K and V block (2 · b · seq/cp · kv_heads · head_dim elements),
backward twice that. Prints a markdown table.
"""
from __future__ import annotations

import argparse

import spmd
from models.llama import Llama, LlamaConfig


def ring_formula(cfg: LlamaConfig, batch: int, seq: int, cp: int, element: int = 4) -> int:
    return cfg.n_layers * (cp - 1) * 2 * batch * (seq // cp) * cfg.n_kv_heads * cfg.head_dim * element


def row(cfg: LlamaConfig, batch: int, seq: int, cp: int) -> dict:
    plan = spmd.explain(Llama(cfg), spmd.Rules.default(), {"cp": cp}, batch_shape=(batch, seq))
    sent = {ph: sum(c.bytes for c in plan.collectives if c.kind == "send" and c.phase == ph and "ring" in c.reason)
            for ph in ("forward", "backward")}
    return {"cp": cp, "activations": plan.memory["activations"], **sent, "formula": ring_formula(cfg, batch, seq, cp)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args(argv)
    cfg = LlamaConfig.preset(a.model, kernels="torch")
    rows = [row(cfg, a.batch, a.seq, cp) for cp in a.cp]
    base = rows[0]["activations"]
    print(f"{a.model}, batch {a.batch} x seq {a.seq}, fp32, bytes per rank per step")
    print("| cp | activations | vs first | ring sent forward | backward | formula forward |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['activations']:,} | {r['activations'] / base:.3f} | {r['forward']:,} | "
              f"{r['backward']:,} | {r['formula']:,} |")


if __name__ == "__main__":
    main()
