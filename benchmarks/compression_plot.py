"""The convergence curves of benchmarks.compression's results as a PNG beside them.

    python -m benchmarks.compression_plot results/A-compression-small-int4.json [results/B.json ...]

Top panel: each option's loss per step, smoothed by a moving mean of `--window` steps; bottom: that smoothed
loss over the uncompressed run's, with the 2% band the options are held to. Several results files draw
into one figure, an option named in an earlier file taking precedence (an uncompressed run once). The PNG
goes next to the first file (`--out` to choose). Needs matplotlib (`pip install 'spmd[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def smooth(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def curves(paths: list[Path]) -> dict[str, list[float]]:
    """{option: losses per step} over the files, the first file naming an option keeping it."""
    out = {}
    for path in paths:
        losses = json.loads(Path(path).read_text()).get("losses") or {}
        if not losses:
            raise ValueError(f"{path} holds no convergence runs; pass a benchmarks.compression results file")
        for name, run in losses.items():
            out.setdefault(name, run["losses"])
    if "none" not in out:
        raise ValueError("no uncompressed ('none') run among the files: its curve is what the ratios divide by")
    return out


def render(losses: dict[str, list[float]], out: Path, window: int = 20) -> Path:
    """The figure of {option: losses per step} (one named 'none') written to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: smooth(values, window) for name, values in losses.items()}
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 7), height_ratios=(3, 2))
    base = runs["none"]
    for name, values in runs.items():
        steps = range(1, len(values) + 1)
        style = {"color": "black", "lw": 2.0} if name == "none" else {"lw": 1.2}
        top.plot(steps, values, label=name, **style)
        bottom.plot(steps, [v / b for v, b in zip(values, base)], label=name, **style)
    top.set_ylabel(f"loss (mean of {window} steps)")
    top.legend(fontsize=8)
    top.set_title("Quantized wire vs full precision: training loss")
    bottom.axhspan(0.98, 1.02, color="0.9", label="within 2%")
    bottom.set_ylabel("/ none")
    bottom.set_xlabel("step")
    bottom.set_ylim(0.9, 1.12)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="the PNG (default: the first file's name with .png)")
    p.add_argument("--window", type=int, default=20)
    args = p.parse_args(argv)
    out = render(curves(args.results), args.out or args.results[0].with_suffix(".png"), args.window)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
