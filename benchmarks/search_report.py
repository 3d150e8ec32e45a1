"""The spec search as a results file: `python -m benchmarks.search_report --model 8b --world 64 --device h100`.

Writes results/<date>-search-<model>-<world>x<device>.{json,md}: `spmd.search`'s ranking (a prediction, not a
measurement; spmd/analysis/search.py says how each term is modelled) with the commit it was made at.
"""
import argparse
import os
from pathlib import Path

import models
import spmd
from benchmarks import common


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", help="PRESET or MODEL:PRESET of the model registry")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: world)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: min(max_seq_len, 4096))")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8))
    ap.add_argument("--out", default=str(common.RESULTS))
    a = ap.parse_args(argv)
    cfg = models.preset(a.model)
    batch_shape = (a.batch or a.world, a.seq or min(cfg.max_seq_len, 4096))
    rows = spmd.search(cfg, a.world, a.device, batch_shape=batch_shape, dtype=a.dtype, workers=a.workers)
    report = {"environment": common.environment(), "args": vars(a), **rows.to_dict()}
    name = a.model.replace(":", "-")
    markdown = (f"# spmd.search: {name} on {a.world} x {a.device} (prediction, not a measurement)\n\n"
                f"`python -m benchmarks.search_report --model {a.model} --world {a.world} --device {a.device}` "
                f"at commit {report['environment']['commit'][:12]}; spmd/analysis/search.py says how compute, "
                f"each collective and memory are modelled.\n\n```\n{rows.table()}\n```")
    js, md = common.write(Path(a.out) / f"{common.today()}-search-{name}-{a.world}x{a.device}", report, markdown)
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
