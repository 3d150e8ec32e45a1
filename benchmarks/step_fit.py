"""This machine as a `Device` for the step-time model, from measurements: link figures per collective kind
fitted to collectives timed inside real steps, compute from a GEMM probe of the model's own linear shapes.

The fit: per collective kind (all_reduce, all_gather, reduce_scatter, all_to_all where present), least squares
of t = latency + ring steps x step latency + wire bytes / bandwidth over its samples (benchmarks.spec_steps
times them, spmd.analysis.timed), none negative; every sample pooled gives the single link a kind without
samples falls back to. Each spec is predicted with links fitted to the collectives of the other specs, of
every model measured in the same rounds (`held_out`: leave one spec out): none of its own runs enter its
device, and the fit still sees the message sizes of every model (a fit to one model's small messages alone
extrapolates bandwidth poorly to another's large ones).
"""

from __future__ import annotations

__all__ = ["fit_link", "fit_kinds", "held_out", "device_for", "fitted_devices", "link_words"]


def fit_link(rows: list[dict], nproc: int, robust: bool = False) -> dict:
    """{latency_s, step_latency_s, bandwidth_Bps} minimising the squared error of t = latency + steps x
    step latency + wire / bandwidth (`robust`: the absolute error, so that a few slow samples do not drag the
    line), none negative. A sample without `ranks` (reports before the per-step term) was timed over all
    `nproc` processes."""
    import torch

    from spmd.analysis.record import ring_steps

    steps = [ring_steps(r["kind"], r.get("ranks", nproc)) for r in rows]
    x = torch.tensor([[1.0, s, r["wire_bytes"]] for s, r in zip(steps, rows)], dtype=torch.float64)
    t = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1e-30)
    # a column the samples do not vary (one group size: one ring-step count) cannot be told from the latency
    terms = [0] + [i for i in (1, 2) if len(set(x[:, i].tolist())) > 1]
    while True:  # drop a term that fits negative and refit the others
        coef = _solve(x[:, terms] / scale[terms], t, 30 if robust else 1) / scale[terms]
        if all(c >= 0 for c in coef) or len(terms) == 1:
            break
        terms.pop(int(torch.argmin(coef)))
    fit = dict.fromkeys(range(3), 0.0) | {i: max(float(c), 0.0) for i, c in zip(terms, coef)}
    return {"latency_s": fit[0], "step_latency_s": fit[1], "bandwidth_Bps": 1.0 / max(fit[2], 1e-15)}


def _solve(a, t, rounds: int):
    """Least squares of a @ coef = t, reweighted `rounds - 1` times by 1/sqrt|residual| (iteratively
    reweighted least squares: it converges to the least absolute error)."""
    import torch

    w = torch.ones_like(t)
    for _ in range(rounds):
        coef = torch.linalg.lstsq(a * w[:, None], (t * w)[:, None]).solution[:, 0]
        w = (t - a @ coef).abs().clamp_min(1e-9 * t.abs().mean()).rsqrt()
    return coef


def fit_kinds(rows: list[dict], nproc: int) -> dict:
    """{kind: fit_link of that kind's samples, with `samples` (how many), `groups` (how many distinct (ranks,
    bytes)) and `rel_rms` (the fit's root mean square error over the mean time)}, and "pooled": every sample in
    one fit. Each fit is to the median time of each (kind, ranks, bytes), least absolute error: a collective
    that waited for a rank the machine had descheduled is one slow sample among its like, not a pull on the
    line."""
    by_kind: dict = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    out = {}
    for kind, kind_rows in sorted(by_kind.items()) + [("pooled", rows)]:
        medians = _medians(kind_rows, nproc)
        fit = fit_link(medians, nproc, robust=True)
        out[kind] = {**fit, "samples": len(kind_rows), "groups": len(medians), "rel_rms": _rel_rms(fit, medians, nproc)}
    return out


def _medians(rows: list[dict], nproc: int) -> list[dict]:
    """One row per (kind, ranks, wire bytes) of `rows`, its time the median of theirs."""
    import statistics

    like: dict = {}
    for r in rows:
        like.setdefault((r["kind"], r.get("ranks", nproc), r["wire_bytes"]), []).append(r["seconds"])
    return [{"kind": k, "ranks": n, "wire_bytes": b, "seconds": statistics.median(t)} for (k, n, b), t in like.items()]


def _rel_rms(fit: dict, rows: list[dict], nproc: int) -> float:
    from spmd.analysis.record import ring_steps

    def model(r):
        steps = ring_steps(r["kind"], r.get("ranks", nproc))
        return fit["latency_s"] + steps * fit["step_latency_s"] + r["wire_bytes"] / fit["bandwidth_Bps"]

    mean = sum(r["seconds"] for r in rows) / len(rows)
    return (sum((model(r) - r["seconds"]) ** 2 for r in rows) / len(rows)) ** 0.5 / mean


def held_out(spec: str, samples: list[dict]) -> list[dict]:
    """The samples `spec` is predicted with: those of every other spec, of every model (a spec's name left out
    of each model)."""
    rows = [s for s in samples if s["spec"] != spec]
    if not rows:
        raise ValueError(f"no held-out samples for {spec}: measure at least two specs")
    return rows


def device_for(nproc: int, per_thread: float, fits: dict):
    """`cpu_device` of `nproc` one-thread ranks at `per_thread` FLOP/s, its links fitted per kind (`fits`,
    from fit_kinds), the pooled fit for kinds without samples."""
    from spmd.analysis.devices import Link, cpu_device

    link = lambda f: Link(f["latency_s"], f["step_latency_s"], f["bandwidth_Bps"])  # noqa: E731
    pooled = fits["pooled"]
    return cpu_device(
        nproc,
        1,
        per_thread,
        bandwidth=pooled["bandwidth_Bps"],
        latency=pooled["latency_s"],
        step_latency=pooled["step_latency_s"],
        kind_links={k: link(f) for k, f in fits.items() if k != "pooled"},
    )


def fitted_devices(a, measured: list[dict], specs: dict) -> dict:
    """Per model: its linear layers' FLOP/s per thread, the per-kind link fits of every sample (`fits`, shown),
    and per spec the fits of its held-out samples (`per_spec`, what its prediction uses)."""
    samples = [c | {"model": j["model"], "spec": j["spec"]} for j in measured for c in j["collectives"]]
    every = fit_kinds(samples, a.nproc)
    print("[search_vs_measured] every sample: " + "; ".join(f"{k} {link_words(f)}" for k, f in every.items()))
    # a spec's held-out samples are the same whichever model it is ranked for: fitted once per spec name
    by_spec = {spec: fit_kinds(held_out(spec, samples), a.nproc) for spec in {s for m in a.models for s in specs[m]}}
    out = {}
    for m in a.models:
        out[m] = {
            "peak_per_thread": _linear_flops(m, a.batch * a.seq // a.nproc),
            "fits": every,
            "per_spec": {spec: by_spec[spec] for spec in specs[m]},
        }
        print(f"[search_vs_measured] {m}: {out[m]['peak_per_thread'] / 1e9:.1f} GFLOP/s per thread")
    return out


def _linear_flops(model: str, tokens: int) -> float:
    import torch

    from models.llama import LlamaConfig
    from spmd.analysis.devices import measure_linear_flops

    with torch.device("meta"):
        net = LlamaConfig.preset(model).build()
    return measure_linear_flops(net, tokens, threads=1, budget_s=1.0)


def link_words(link: dict) -> str:
    return (
        f"latency {1e6 * link['latency_s']:.0f} us + {1e6 * link['step_latency_s']:.0f} us "
        f"per ring step, bandwidth {link['bandwidth_Bps'] / 1e9:.2f} GB/s"
    )
