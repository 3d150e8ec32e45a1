"""Tokens/s of transformers' LlamaForCausalLM (`--model hf:DIR`) against models/llama.py of the same config,
on the same spec, through the same trainer.

    python -m benchmarks.hf_llama --model small --nproc 4 --specs fsdp=4 fsdp=2,tp=2,sp pp=2,fsdp=2 \
        [--repeats 5] [--steps 10] [--warmup 3] [--seq-len 128] [--batch-size 8] [--dtype fp32]

DIR is written from the preset by `models.llama_hf.hf_config` (config.json only: transformers initialises it
under the seed, so the two losses differ by their initialisations, not their math). For each spec the two
models run alternately, `--repeats` times each (ours then theirs, then theirs then ours, ...: a slow drift of a
shared machine hits both alike); each run's tokens/s is the median of its steps after `--warmup`. The report gives per
model the median over repeats and the spread (max-min)/median, and transformers / ours as the median of the per-repeat
ratios. Writes benchmarks/results/<date>-<device>-hf-llama-<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import common


def _write_dir(preset: str, path: Path) -> str:
    from models.llama import LlamaConfig
    from models.llama_hf import hf_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({**hf_config(LlamaConfig.preset(preset)), "bos_token_id": 0, "eos_token_id": 0})
    )
    return str(path)


def _run(a, model: str, spec: str, jsonl: Path) -> dict:
    sizes = ",".join(p for p in spec.split(",") if p.strip() != "sp")
    cmd = common.torchrun(a.nproc) + [
        "-m",
        "launch.train",
        "--model",
        model,
        "--mesh",
        sizes,
        *(["--sp"] if "sp" in spec.split(",") else []),
        "--steps",
        str(a.steps),
        "--batch-size",
        str(a.batch_size),
        "--seq-len",
        str(a.seq_len),
        "--dtype",
        a.dtype,
        "--seed",
        "0",
        "--metrics",
        str(jsonl),
    ]
    common.run(cmd, timeout=a.timeout)
    return common.steady(common.read_jsonl(jsonl), a.warmup)


def _summary(runs: list[dict]) -> dict:
    tps = [r["tokens_per_s"] for r in runs]
    med = statistics.median(tps)
    return {
        "tokens_per_s": med,
        "spread": (max(tps) - min(tps)) / med,
        "runs": tps,
        "final_losses": [r["final_loss"] for r in runs],
    }


def markdown(rep: dict) -> str:
    env, a = rep["environment"], rep["args"]
    rows = [
        [
            r["spec"],
            f"{r['ours']['tokens_per_s']:,.0f} ({100 * r['ours']['spread']:.0f}%)",
            f"{r['hf']['tokens_per_s']:,.0f} ({100 * r['hf']['spread']:.0f}%)",
            f"{r['ratio']:.3f}",
        ]
        for r in rep["rows"]
    ]
    return "\n".join(
        [
            f"# transformers' Llama vs models/llama.py: {a['model']} on {a['nproc']} x {env['device']}",
            "",
            f"{env['date']}, torch {env['torch']}, load average {env.get('loadavg_1m', float('nan')):.1f} at start; "
            f"global batch {a['batch_size']} x {a['seq_len']}, {a['dtype']}; {a['repeats']} alternating repeats of "
            f"{a['steps']} steps, first {a['warmup']} discarded.",
            "",
            common.md_table(
                [
                    "spec",
                    "models/llama.py tok/s (spread)",
                    "transformers tok/s (spread)",
                    "transformers / ours (median of per-repeat ratios)",
                ],
                rows,
            ),
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a preset of models/llama.py")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--specs", nargs="+", default=["fsdp=4", "fsdp=2,tp=2,sp", "pp=2,fsdp=2"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(common.RESULTS))
    a = ap.parse_args(argv)
    if a.warmup >= a.steps:
        ap.error(f"--warmup {a.warmup} must be smaller than --steps {a.steps}")
    rep = {"environment": common.environment(), "args": vars(a), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        hf = f"hf:{_write_dir(a.model, Path(tmp, 'hf'))}"
        for spec in a.specs:
            runs = {"ours": [], "hf": []}
            for i in range(a.repeats):
                pair = [("ours", a.model), ("hf", hf)]
                for kind, model in pair if i % 2 == 0 else pair[::-1]:
                    runs[kind].append(_run(a, model, spec, Path(tmp, f"{kind}-{i}.jsonl")))
            ratio = statistics.median(h["tokens_per_s"] / o["tokens_per_s"] for o, h in zip(runs["ours"], runs["hf"]))
            row = {"spec": spec, "ours": _summary(runs["ours"]), "hf": _summary(runs["hf"]), "ratio": ratio}
            print(
                f"[hf_llama] {spec}: ours {row['ours']['tokens_per_s']:,.0f} tok/s, transformers "
                f"{row['hf']['tokens_per_s']:,.0f} tok/s, ratio {ratio:.3f}",
                flush=True,
            )
            rep["rows"].append(row)
    stem = Path(a.out) / f"{common.today()}-{common.device_slug()}-hf-llama-{a.model}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    js, md = common.write(stem, rep, markdown(rep))
    print(f"[hf_llama] wrote {js}, {md}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
