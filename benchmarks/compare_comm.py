"""Communication and memory per rank per step, three ways, side by side: the analytic model
(benchmarks/analytic.py), `spmd.explain` on a fake world, and a real multi-process CPU run.

    python -m benchmarks.compare_comm [--models tiny small] [--nproc 4] [--batch 8] [--seq 64]

Measured (one torchrun launch per model and dtype; every spec in turn inside it, on fresh meshes):
  recorder   spmd.analysis.record.CollectiveRecorder during one forward + backward: bytes by the ring convention
  CommDebugMode  torch's own count of collectives by type (independent of spmd's recorder)
  wire       bytes this process wrote to its sockets (/proc/self/io wchar) during forward + backward: what
             gloo really sent, with its own algorithms and message headers
  optimizer  the collectives of the rest of a trainer step (global-norm clipping, AdamW), recorded
  states     local bytes of parameters, gradients and AdamW's exp_avg/exp_avg_sq after the step
  saved      bytes of the tensors autograd saved in the real forward (explain's activation estimate)
The trainer's own JSONL `comm_bytes` is checked against recorder + optimizer for one spec per model.

Fake worlds (explain vs analytic only): larger models and meshes no CPU can run, including a tied-embedding
model (1b). Writes benchmarks/results/<date>-<device>-compare-comm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks import analytic as A
from benchmarks import common

MEASURED_SPECS = [
    "dp=4",
    "fsdp=4",
    "dp=2,fsdp=2",
    "tp=4",
    "tp=4,sp",
    "fsdp=2,tp=2",
    "fsdp=2,tp=2,sp",
    "dp=2,tp=2,sp",
    "dp=2,tp=2",
]
FAKE_CASES = [  # (model, spec, batch, seq, dtype)
    ("8b", "fsdp=8,tp=8,sp", 64, 4096, "bf16"),
    ("8b", "dp=8,fsdp=4,tp=2", 64, 4096, "bf16"),
    ("8b", "fsdp=64", 64, 4096, "bf16"),
    ("1b", "fsdp=8", 16, 2048, "bf16"),
    ("1b", "dp=2,fsdp=2,tp=2,sp", 16, 2048, "bf16"),
    ("small", "dp=2,fsdp=4,tp=4,sp", 32, 256, "fp32"),
]
_KIND = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allreduce_": "all_reduce",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
}


def model_config(name: str):
    from models.llama import LlamaConfig

    return LlamaConfig.preset(name, kernels="torch")


# ------------------------------------------------------------------------------------------ worker (torchrun)
def _wchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def worker(args: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import spmd
    from models.llama import Llama
    from spmd.analysis.memory import activation_bytes
    from spmd.analysis.record import CollectiveRecorder
    from spmd.runtime.parameters.reshard import observe_saved

    rank = int(os.environ["RANK"])
    cfg = model_config(args["model"])
    param_dtype = {"fp32": None, "bf16": torch.bfloat16}[args["dtype"]]
    out, meshes = [], []
    for spec in args["specs"]:
        sizes, flags = spmd.parse_spec(spec)
        mesh = spmd.make_mesh(sizes)
        meshes.append(mesh)
        torch.manual_seed(0)
        rules = spmd.Rules.default(sequence_parallel="sp" in flags)
        model = spmd.parallelize(Llama(cfg), mesh, rules, param_dtype=param_dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"] + 1), generator=g)
        dp_rank = rules.data_parallel_rank(mesh)
        per = args["batch"] // rules.data_parallel_size(mesh)
        rows = tokens[dp_rank * per : (dp_rank + 1) * per]
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # own storage, as explain's inputs have
        recorder, saved = CollectiveRecorder(mesh), {}
        # DTensor treats equal meshes (same shape and names) as one: its cached layouts may still point at an
        # earlier spec's mesh, whose groups the recorder must also know by axis name
        for old in meshes:
            for name in old.mesh_dim_names:
                recorder.group_axes.setdefault(old.get_group(name).group_name, (name,))
        dist.barrier()
        w0 = _wchar()
        with CommDebugMode() as comm, recorder:
            with observe_saved(saved):
                loss = model(x, y)
            loss.backward()
        w1 = _wchar()
        dist.barrier()
        opt_rec = CollectiveRecorder(mesh)
        opt_rec.group_axes.update(recorder.group_axes)
        w2 = _wchar()
        with opt_rec:  # the rest of the trainer's step: global-norm clipping and AdamW
            norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=None)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            opt.step()
        w3 = _wchar()
        states = {
            "parameters": sum(_local_bytes(p) for p in model.parameters()),
            "gradients": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer": sum(_local_bytes(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")),
        }
        counts = Counter()
        for op, n in comm.get_comm_counts().items():
            counts[_KIND.get(getattr(op, "__name__", str(op)).split(".")[0], str(op))] += n
        gloo_expected = sum(2 * c.bytes if c.kind == "reduce_scatter" else c.bytes for c in recorder.records)
        out.append(
            {
                "spec": spec,
                "rank": rank,
                "loss": float(loss),
                "records": [c.to_dict() for c in recorder.records],
                "recorder_bytes": sum(c.bytes for c in recorder.records),
                "recorder_count": len(recorder.records),
                "comm_debug_counts": dict(counts),
                "wire_bytes": w1 - w0,
                "gloo_expected_wire": gloo_expected,
                "optimizer_bytes": sum(c.bytes for c in opt_rec.records),
                "optimizer_count": len(opt_rec.records),
                "optimizer_wire": w3 - w2,
                "states": states,
                "saved_bytes": activation_bytes(saved, model),
            }
        )
        del model, opt
        dist.barrier()
    Path(args["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------ driver
def measure(model: str, dtype: str, specs: list[str], nproc: int, batch: int, seq: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = {"model": model, "dtype": dtype, "specs": specs, "batch": batch, "seq": seq, "out": tmp}
        common.run(common.torchrun(nproc) + ["-m", "benchmarks.compare_comm", "--worker", json.dumps(args)])
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)]
    out = {}
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in ranks]
        row = dict(per_rank[0])
        row["wire_bytes_per_rank"] = [r["wire_bytes"] for r in per_rank]
        row["wire_bytes"] = sum(row["wire_bytes_per_rank"]) / nproc
        row["gloo_expected_wire"] = sum(r["gloo_expected_wire"] for r in per_rank) / nproc
        row["recorder_bytes_per_rank"] = [r["recorder_bytes"] for r in per_rank]
        out[spec] = row
    return out


def explain_plan(cfg, spec: str, batch: int, seq: int, dtype: str):
    import spmd
    from models.llama import Llama

    sizes, flags = spmd.parse_spec(spec)
    with torch.device("meta"):
        model = Llama(cfg)
    return spmd.explain(
        model, spmd.Rules.default(sequence_parallel="sp" in flags), sizes, batch_shape=(batch, seq), dtype=dtype
    )


def _by_axis(records) -> dict:
    out: dict = {}
    for c in records:
        axis = "+".join(c["axes"]) if isinstance(c, dict) else "+".join(c.axes)
        out[axis] = out.get(axis, 0) + (c["bytes"] if isinstance(c, dict) else c.bytes)
    return out


def compare_row(model: str, cfg, spec: str, batch: int, seq: int, dtype: str, measured: dict | None) -> dict:
    t0 = time.perf_counter()
    plan = explain_plan(cfg, spec, batch, seq, dtype)
    explain_s = time.perf_counter() - t0
    an = A.comm(cfg, spec, batch, seq, dtype)
    states = A.model_states(cfg, spec)
    plan_states = sum(plan.memory[k] for k in ("parameters", "gradients", "optimizer"))
    row = {
        "model": model,
        "spec": spec,
        "world": A.Spec.parse(spec).world,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "analytic": {
            "bytes": an.total(),
            "textbook_bytes": an.total(textbook_only=True),
            "count": an.count(),
            "by_axis": an.by_axis(),
            "terms": an.to_dict()["terms"],
            "model_states": states["total"],
        },
        "explain": {
            "bytes": plan.comm_bytes(),
            "count": len(plan.collectives),
            "by_axis": _by_axis(plan.collectives),
            "model_states": plan_states,
            "activations": plan.memory["activations"],
            "seconds": explain_s,
            "implicit": sum(1 for c in plan.collectives if c.origin == "implicit"),
        },
        "ratios": {
            "explain/analytic": plan.comm_bytes() / an.total(),
            "explain/textbook": plan.comm_bytes() / an.total(textbook_only=True),
            "explain/analytic states": plan_states / states["total"],
        },
    }
    if measured is not None:
        m = measured
        planned = Counter((c.module, c.kind, c.axes, c.bytes, c.phase) for c in plan.collectives)
        real = Counter((c["module"], c["kind"], tuple(c["axes"]), c["bytes"], c["phase"]) for c in m["records"])
        by_kind = Counter(c.kind for c in plan.collectives)
        measured_states = sum(m["states"].values())
        row["measured"] = {
            k: m[k]
            for k in (
                "recorder_bytes",
                "recorder_count",
                "comm_debug_counts",
                "wire_bytes",
                "wire_bytes_per_rank",
                "gloo_expected_wire",
                "optimizer_bytes",
                "optimizer_count",
                "optimizer_wire",
                "states",
                "saved_bytes",
                "loss",
            )
        }
        row["measured"]["records_equal_plan"] = planned == real
        row["measured"]["comm_debug_equals_plan"] = dict(by_kind) == m["comm_debug_counts"]
        row["ratios"].update(
            {
                "measured/explain": m["recorder_bytes"] / plan.comm_bytes(),
                "measured/analytic": m["recorder_bytes"] / an.total(),
                "wire/ring convention": m["wire_bytes"] / m["recorder_bytes"],
                "wire/gloo algorithms": m["wire_bytes"] / m["gloo_expected_wire"],
                "measured/explain states": measured_states / plan_states,
                "measured/explain saved": m["saved_bytes"] / plan.memory["activations"],
            }
        )
    return row


def trainer_check(model: str, spec: str, nproc: int, batch: int, seq: int, dtype: str) -> dict:
    """Runs the trainer for 2 steps and returns its JSONL comm_bytes (per rank per step)."""
    sizes = spec.replace(",sp", "")
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp, "m.jsonl")
        cmd = common.torchrun(nproc) + [
            "-m",
            "launch.train",
            "--model",
            model,
            "--mesh",
            sizes,
            "--steps",
            "2",
            "--batch-size",
            str(batch),
            "--seq-len",
            str(seq),
            "--dtype",
            dtype,
            "--warmup",
            "1",
            "--metrics",
            str(jsonl),
        ]
        if ",sp" in spec:
            cmd.append("--sp")
        common.run(cmd)
        rows = common.read_jsonl(jsonl)
    return {"model": model, "spec": spec, "comm_bytes": [r["comm_bytes"] for r in rows]}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Communication and memory per rank per step: analytic vs explain vs measured",
        "",
        f"{env['date']}, {env['device']}, torch {env['torch']}, {env['cpu_count']} cores "
        f"(load average {env.get('loadavg_1m', float('nan')):.1f} at start)",
        "",
        "Bytes per rank per step (forward + backward + gradient reduction), ring convention of spmd.analysis.record. "
        "`wire` is what each gloo process really wrote to its sockets (/proc/self/io), mean over ranks.",
        "",
    ]
    heads = [
        "model",
        "spec",
        "dtype",
        "analytic B",
        "explain B",
        "measured B",
        "explain/analytic",
        "measured/explain",
        "count a/e/m",
        "CommDebugMode = plan",
        "records = plan",
        "wire B",
        "wire/ring",
        "wire/gloo",
        "states a/e/m",
        "saved m/e",
    ]
    rows = []
    for r in report["measured"]:
        m, a, e, q = r["measured"], r["analytic"], r["explain"], r["ratios"]
        rows.append(
            [
                r["model"],
                r["spec"],
                r["dtype"],
                a["bytes"],
                e["bytes"],
                m["recorder_bytes"],
                q["explain/analytic"],
                q["measured/explain"],
                f"{a['count']}/{e['count']}/{m['recorder_count']}",
                m["comm_debug_equals_plan"],
                m["records_equal_plan"],
                int(m["wire_bytes"]),
                q["wire/ring convention"],
                q["wire/gloo algorithms"],
                f"{q['explain/analytic states']:.3g}/{q['measured/explain states']:.3g}",
                q["measured/explain saved"],
            ]
        )
    lines += ["## Real runs (CPU, gloo)", "", common.md_table(heads, rows), ""]
    lines += [
        "Rest of the trainer step (clipping + AdamW), measured: "
        + ", ".join(
            f"{r['model']} {r['spec']}: {r['measured']['optimizer_count']} all-reduces, "
            f"{r['measured']['optimizer_bytes']:,} B"
            for r in report["measured"][:3]
        )
        + ", ...",
        "",
    ]
    if report.get("trainer"):
        lines += ["Trainer JSONL `comm_bytes` vs measured forward+backward+optimizer:", ""]
        for t in report["trainer"]:
            lines.append(
                f"- {t['model']} {t['spec']} {t['dtype']}: trainer {t['comm_bytes']} vs measured "
                f"{t['expected']:,} (ratio {t['ratio']:.4f})"
            )
        lines.append("")
    heads = [
        "model",
        "spec",
        "world",
        "dtype",
        "batch x seq",
        "analytic B",
        "textbook B",
        "explain B",
        "explain/analytic",
        "explain/textbook",
        "states e/a",
        "explain s",
    ]
    rows = [
        [
            r["model"],
            r["spec"],
            r["world"],
            r["dtype"],
            f"{r['batch']}x{r['seq']}",
            r["analytic"]["bytes"],
            r["analytic"]["textbook_bytes"],
            r["explain"]["bytes"],
            r["ratios"]["explain/analytic"],
            r["ratios"]["explain/textbook"],
            r["ratios"]["explain/analytic states"],
            r["explain"]["seconds"],
        ]
        for r in report["fake"]
    ]
    lines += ["## Fake worlds (explain vs analytic)", "", common.md_table(heads, rows), ""]
    lines += ["## Findings", ""] + [f"- {f}" for f in report["findings"]]
    lines += [
        "",
        "Terms of the analytic model beyond the textbook formulas (per spec in the JSON): TP embedding + "
        "output activations, vocab-parallel loss all-reduces, SP norm-weight gradient all-reduces, the input "
        "embedding's skipped backward gather, fp32 gradient reduction under bf16.",
    ]
    return "\n".join(lines)


def findings(report: dict) -> list[str]:
    out = []
    meas = report["measured"]
    exact = [r for r in meas if r["ratios"]["explain/analytic"] == 1 and r["ratios"]["measured/explain"] == 1]
    out.append(
        f"{len(exact)}/{len(meas)} real-run cases: analytic = explain = measured bytes exactly (ratio 1.0000); "
        f"records equal the plan one to one in {sum(r['measured']['records_equal_plan'] for r in meas)}/{len(meas)}, "
        f"CommDebugMode's counts by type equal the plan in "
        f"{sum(r['measured']['comm_debug_equals_plan'] for r in meas)}/{len(meas)}."
    )
    rs = [r for r in meas if "fsdp" in r["spec"] or ",sp" in r["spec"]]  # the specs with reduce-scatters
    if rs:
        wr = [r["ratios"]["wire/ring convention"] for r in rs]
        wg = [r["ratios"]["wire/gloo algorithms"] for r in meas]
        out.append(
            f"gloo sends more than the ring convention for specs with reduce-scatters (wire/ring "
            f"{min(wr):.2f}-{max(wr):.2f}): gloo's reduce_scatter is an all-reduce followed by a slice, "
            f"2S(n-1)/n instead of S(n-1)/n. Counting reduce-scatters as all-reduces, wire/expected is "
            f"{min(wg):.3f}-{max(wg):.3f} (the rest is gloo's message headers and small-message algorithms). "
            f"NCCL's reduce-scatter is a ring: the convention holds there."
        )
    for r in report["fake"]:
        if abs(r["ratios"]["explain/analytic"] - 1) < 1e-12:
            continue
        extra = {
            k: v - r["analytic"]["by_axis"].get(k, 0)
            for k, v in r["explain"]["by_axis"].items()
            if v != r["analytic"]["by_axis"].get(k, 0)
        }
        text = (
            f"{r['model']} {r['spec']}: explain/analytic {r['ratios']['explain/analytic']:.4f}, explain has "
            + ", ".join(f"{v:+,} B over {k}" for k, v in extra.items())
            + f" and {r['explain']['count'] - r['analytic']['count']:+d} collectives per rank"
        )
        if "tie" in r.get("note", ""):
            text += (
                ": the tied embedding/output weight. spmd gathers it twice in forward (for the embedding and "
                "for the output projection) and reduces its two gradient contributions separately (a second "
                "reduce-scatter over fsdp, a second all-reduce over dp), where the formula counts the shared "
                "weight once (3Ψ). The excess is exactly one more all-gather (compute dtype) plus one more "
                "fp32 gradient reduction of the tied weight: an spmd inefficiency, not an accounting error"
            )
        out.append(text + ".")
    out.append(
        "spmd.analysis.record.CollectiveRecorder(mesh) names axes from that mesh's process groups. After a second "
        "DeviceMesh of the same shape is made in one process, DTensor's cached layouts can still hold the "
        "first mesh (equal meshes compare equal), so collectives run on the first mesh's groups and the "
        "recorder labels them with bare group names. The worker here registers every mesh's groups; a fix "
        "in the recorder would map groups by their ranks."
    )
    states_off = [r for r in meas + report["fake"] if abs(r["ratios"]["explain/analytic states"] - 1) > 1e-9]
    if not states_off:
        out.append(
            "Model-state bytes: analytic = explain in every case; measured (real local shards after an AdamW "
            "step) = explain in every real run."
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--specs", nargs="+", default=MEASURED_SPECS)
    ap.add_argument("--bf16-specs", nargs="*", default=["fsdp=2,tp=2,sp", "dp=2,fsdp=2"])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-fake", action="store_true", help="skip the large fake-world cases")
    ap.add_argument("--no-trainer", action="store_true", help="skip the trainer cross-check")
    ap.add_argument("--out", default=str(common.RESULTS))
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    report = {"environment": common.environment(), "nproc": a.nproc, "measured": [], "fake": [], "trainer": []}
    for model in a.models:
        cfg = model_config(model)
        for dtype, specs in (("fp32", a.specs), ("bf16", a.bf16_specs)):
            specs = [s for s in specs if A.Spec.parse(s).world == a.nproc]
            if not specs:
                continue
            print(f"[compare_comm] {model} {dtype}: measuring {len(specs)} specs on {a.nproc} processes", flush=True)
            measured = measure(model, dtype, specs, a.nproc, a.batch, a.seq)
            for spec in specs:
                row = compare_row(model, cfg, spec, a.batch, a.seq, dtype, measured[spec])
                row["measured"]["records"] = measured[spec]["records"]
                report["measured"].append(row)
                q = row["ratios"]
                print(
                    f"  {spec:<18} {dtype} explain/analytic {q['explain/analytic']:.4f} measured/explain "
                    f"{q['measured/explain']:.4f} wire/gloo {q['wire/gloo algorithms']:.3f}",
                    flush=True,
                )
        if not a.no_trainer:
            spec = "fsdp=2,tp=2,sp"
            t = trainer_check(model, spec, a.nproc, a.batch, a.seq, "fp32")
            m = next(
                r for r in report["measured"] if r["model"] == model and r["spec"] == spec and r["dtype"] == "fp32"
            )
            t["dtype"] = "fp32"
            t["expected"] = m["measured"]["recorder_bytes"] + m["measured"]["optimizer_bytes"]
            t["ratio"] = t["comm_bytes"][-1] / t["expected"]
            report["trainer"].append(t)
            print(f"  trainer {model} {spec}: comm_bytes {t['comm_bytes']} vs measured {t['expected']:,}", flush=True)
    if not a.no_fake:
        for model, spec, batch, seq, dtype in FAKE_CASES:
            cfg = model_config(model)
            row = compare_row(model, cfg, spec, batch, seq, dtype, None)
            if cfg.tie_embeddings:
                row["note"] = "tied embeddings"
            report["fake"].append(row)
            print(
                f"  fake {model} {spec}: explain/analytic {row['ratios']['explain/analytic']:.4f} "
                f"({row['explain']['seconds']:.1f}s)",
                flush=True,
            )
    for r in report["measured"]:
        r["measured"].pop("records", None)
    report["findings"] = findings({**report, "measured": report["measured"]})
    stem = Path(a.out) / f"{common.today()}-{common.device_slug()}-compare-comm"
    js, md = common.write(stem, report, markdown(report))
    print(f"[compare_comm] wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    from spmd.layout.mesh import exit_process

    exit_process(main())  # not sys.exit: see exit_process
