"""MFU of each variant of a `benchmarks.overhead` results file: its flops per step over each variant's median
step time and the device's peak (launch.metrics.peak_flops), printed one line per run and variant.

    python -m benchmarks.overhead_mfu benchmarks/results/<date>-<device>-overhead-per-block-8x2048.json
"""

import json
import sys

import torch

from launch.metrics import peak_flops


def mfu_lines(report: dict, peak: float) -> list[str]:
    lines = []
    for run in report["runs"]:
        if "error" in run:
            lines.append(f"{run['model']} {run['dtype']} compile={run['compile']}: {run['error'][:200]}")
            continue
        for variant, step_s in run["step_s"].items():
            lines.append(
                f"{run['model']} {run['dtype']} batch {run['batch']} compile={run['compile']} {variant}: "
                f"{step_s * 1e3:.1f} ms/step, MFU {run['flops_per_step'] / step_s / peak:.1%}"
            )
    return lines


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    for path in paths:
        report = json.loads(open(path).read())
        dtype = report["runs"][0]["dtype"] if report["runs"] else "bf16"
        peak, source = peak_flops(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        print(f"{path} (peak {peak / 1e12:.3g} TFLOP/s, {source})")
        print("\n".join(mfu_lines(report, peak)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
