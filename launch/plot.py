"""Plot training metrics: `python -m launch.plot RUN.jsonl [RUN2.jsonl ...] --out runs.png`.

Reads the `--metrics` JSONL files launch.train writes and draws loss, tokens/s and MFU against the step,
one panel each, every run a line labelled by its file name. A run that validated (`--val-every`) adds its
validation loss to the loss panel: dashed, with a marker per validation, labelled `NAME val`.
Needs matplotlib (`pip install 'spmd[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (("loss", "loss", 1.0), ("tokens_per_s", "tokens/s", 1.0), ("mfu", "MFU (%)", 100.0))


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of one metrics file; ValueError naming the file and line for anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; pass the JSONL file written by launch.train --metrics")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON ({e}); pass a file written by launch.train --metrics") from None
        missing = [k for k in ("step",) + tuple(k for k, _, _ in PANELS) if k not in row]
        if missing:
            raise ValueError(f"{path}:{n} lacks {', '.join(missing)}; pass a file written by launch.train --metrics")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no metrics rows")
    return rows


def _labels(paths: list[Path]) -> list[str]:
    """File names, or whole paths where two runs share a name."""
    names = [p.name for p in paths]
    return [str(p) if names.count(p.name) > 1 else p.name for p in paths]


def _validation_curve(ax, label: str, rows: list[dict], color) -> None:
    """The run's val_loss at the steps it validated after, if any, in its training line's color."""
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["val_loss"] for r in val],
            label=f"{label} val",
            color=color,
            ls="--",
            marker="o",
            ms=3,
            lw=1.2,
        )


def draw(runs: dict[str, list[dict]]):
    """A figure with one panel per metric and one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "launch.plot needs matplotlib: pip install 'spmd[bench]' (or pip install matplotlib)"
        ) from None
    fig, axes = plt.subplots(len(PANELS), 1, sharex=True, figsize=(7, 7.5))
    for ax, (key, ylabel, scale) in zip(axes, PANELS):
        for label, rows in runs.items():
            (line,) = ax.plot([r["step"] for r in rows], [scale * r[key] for r in rows], label=label, lw=1.2)
            if key == "loss":
                _validation_curve(ax, label, rows, line.get_color())
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.plot", description=__doc__.split("\n\n")[1])
    ap.add_argument("metrics", nargs="+", help="JSONL files written by launch.train --metrics")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    try:
        paths = [Path(p) for p in args.metrics]
        runs = {label: read_metrics(p) for label, p in zip(_labels(paths), paths)}
        fig = draw(runs)
    except (ValueError, ImportError) as e:
        print(f"launch.plot: error: {e}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"[launch.plot] {len(runs)} run(s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
