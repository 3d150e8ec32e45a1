"""Kernel benchmarks: `python -m benchmarks.kernels`.

On CUDA: forward+backward time of each Triton kernel against the eager reference and torch.compile of the
reference, at Llama-3-8B shapes (8192 tokens, hidden 4096, vocab 128256, bf16), and the peak memory of the
chunked linear cross-entropy against F.cross_entropy(h @ W.T); its row states the target (LCE_TARGET: at
least eager's speed with at least 2x less peak memory) and whether it is met. On CPU: the linear
cross-entropy alone, plain-torch chunked against eager, time (interleaved rounds, median) and peak memory. Writes
benchmarks/results/<date>-<device>-kernels.{json,md}. All ratios come from one run on one machine.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: `import kernels` must find the package, not this script
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from benchmarks import common
from kernels import reference
from launch.metrics import cpu_name


def _cases(tokens: int, hidden: int, ffn: int, vocab: int, heads: int, kv_heads: int, seq: int, dev="cuda"):
    """name -> (triton fn, reference fn, input factory, shape text)."""
    bf16 = torch.bfloat16
    head_dim = hidden // heads
    batch = tokens // seq

    def rand(*shape, dtype=bf16, grad=True):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)

    def rope_tables():
        inv = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim)
        emb = torch.outer(torch.arange(seq, device=dev).float(), inv).repeat(1, 2)
        return emb.cos(), emb.sin()

    def targets(n):
        t = torch.randint(0, vocab, (n,), device=dev)
        t[::16] = -100
        return t

    return {
        "rms_norm": (
            lambda x, w: kernels.rms_norm(x, w, 1e-5, impl="triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-5),
            lambda: (rand(tokens, hidden), rand(hidden)),
            f"x [{tokens}, {hidden}]",
        ),
        "swiglu": (
            lambda g, u: kernels.swiglu(g, u, impl="triton"),
            reference.swiglu,
            lambda: (rand(tokens, ffn), rand(tokens, ffn)),
            f"gate, up [{tokens}, {ffn}]",
        ),
        "rope": (
            lambda q, k, c, s: kernels.apply_rope(q, k, c, s, impl="triton"),
            reference.apply_rope,
            lambda: (rand(batch, seq, heads, head_dim), rand(batch, seq, kv_heads, head_dim), *rope_tables()),
            f"q [{batch}, {seq}, {heads}, {head_dim}], k [{batch}, {seq}, {kv_heads}, {head_dim}]",
        ),
        "cross_entropy": (
            lambda x, t: kernels.cross_entropy(x, t, impl="triton"),
            reference.cross_entropy,
            lambda: (rand(tokens, vocab), targets(tokens)),
            f"logits [{tokens}, {vocab}]",
        ),
        "linear_cross_entropy": (
            lambda h, w, t: kernels.linear_cross_entropy(h, w, t, impl="triton"),
            reference.linear_cross_entropy,
            lambda: (rand(tokens, hidden), rand(vocab, hidden), targets(tokens)),
            f"hidden [{tokens}, {hidden}], weight [{vocab}, {hidden}]",
        ),
    }


def _fwd_bwd(fn, inputs):
    leaves = [t for t in inputs if t.requires_grad]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    return outs, grads


# the chunked linear cross-entropy's promise at Llama-3-8B shapes (8192 x 4096 x 128256, bf16)
LCE_TARGET = "speedup_vs_eager >= 1.0 and memory_ratio >= 2.0"


def _cuda_ms(fn, inputs, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        _fwd_bwd(fn, inputs)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _fwd_bwd(fn, inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cuda_peak_bytes(fn, inputs) -> int:
    """Peak allocated bytes during forward+backward, above what was allocated before (the inputs)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _fwd_bwd(fn, inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _max_rel_diff(a, b) -> float:
    return max(
        ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b)
    )


def run_cuda(iters: int) -> dict:
    shapes = dict(tokens=8192, hidden=4096, ffn=14336, vocab=128256, heads=32, kv_heads=8, seq=2048)
    rows = []
    for name, (tri, ref, make, shape) in _cases(**shapes).items():
        inputs = make()
        (t_out, t_grad), (r_out, r_grad) = _fwd_bwd(tri, inputs), _fwd_bwd(ref, inputs)
        row = dict(
            kernel=name,
            shape=shape,
            dtype="bf16",
            max_rel_diff_out=_max_rel_diff(t_out, r_out),
            max_rel_diff_grad=_max_rel_diff(t_grad, r_grad),
        )
        del t_out, t_grad, r_out, r_grad
        row["triton_ms"] = _cuda_ms(tri, inputs, iters)
        row["eager_ms"] = _cuda_ms(ref, inputs, iters)
        row["compile_ms"] = _cuda_ms(torch.compile(ref), inputs, iters)
        row["speedup_vs_eager"] = row["eager_ms"] / row["triton_ms"]
        row["speedup_vs_compile"] = row["compile_ms"] / row["triton_ms"]
        if name == "linear_cross_entropy":
            row["triton_peak_gib"] = _cuda_peak_bytes(tri, inputs) / 2**30
            row["eager_peak_gib"] = _cuda_peak_bytes(ref, inputs) / 2**30
            row["memory_ratio"] = row["eager_peak_gib"] / row["triton_peak_gib"]
            row["target"] = LCE_TARGET
            row["meets_target"] = row["speedup_vs_eager"] >= 1.0 and row["memory_ratio"] >= 2.0
        rows.append(row)
        print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), shapes=shapes, results=rows)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created by torch ops while active (inputs made before are not
    counted). Storages are tracked by weak reference and dropped once freed; checked at every op."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ref = StorageWeakRef(t.untyped_storage())
                self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def run_cpu(tokens: int = 2048, hidden: int = 512, vocab: int = 32000, rounds: int = 5) -> dict:
    from kernels.linear_cross_entropy import default_chunk_size
    from kernels.linear_cross_entropy import linear_cross_entropy as chunked

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    t[::16] = -100
    chunk = max(1, tokens // 4)  # four chunks: the default would take all tokens in one at this size
    variants = {
        "naive": lambda: reference.linear_cross_entropy(h, w, t),
        "chunked": lambda: chunked(h, w, t, chunk_size=chunk, use_triton=False),
    }
    row = dict(
        kernel="linear_cross_entropy",
        shape=f"hidden [{tokens}, {hidden}], weight [{vocab}, {hidden}]",
        dtype="fp32",
        chunk=chunk,
        default_chunk=default_chunk_size(tokens, hidden, vocab),
        measure="peak bytes of live tensors created during forward+backward (TorchDispatchMode); "
        f"forward+backward seconds, median of {rounds} interleaved rounds",
    )
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn().backward()
            times[name].append(time.perf_counter() - start)
            h.grad = w.grad = None
    losses = {}
    for name, fn in variants.items():
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_s_spread"] = max(times[name]) - min(times[name])
        with LiveBytes() as mem:  # apart from the timing: the tracker slows every op
            loss = fn()
            loss.backward()
        losses[name] = loss.item()
        row[f"{name}_peak_mib"] = mem.peak / 2**20
        h.grad = w.grad = None
    row["speedup_vs_eager"] = row["naive_s"] / row["chunked_s"]
    row["memory_ratio"] = row["naive_peak_mib"] / row["chunked_peak_mib"]
    row["loss_abs_diff"] = abs(losses["naive"] - losses["chunked"])
    print(json.dumps(row), flush=True)
    return dict(device=f"cpu {cpu_name()}", results=[row])


def _markdown(report: dict) -> str:
    rows = report["results"]
    keys = [k for k in rows[0] if k not in ("shape", "measure")]
    for r in rows[1:]:
        keys += [k for k in r if k not in keys and k not in ("shape", "measure")]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
    env = report["environment"]
    lines = [
        f"# Kernel benchmarks: {report['device']}",
        "",
        f"{env['date']}, torch {env['torch']}, triton {env.get('triton', '-')}, commit {env['commit'][:12]}",
        "",
    ]
    lines += [f"- {r['kernel']}: {r['shape']}" + (f" ({r['measure']})" if "measure" in r else "") for r in rows]
    lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per kernel (CUDA)")
    parser.add_argument(
        "--cpu-shape",
        type=int,
        nargs=3,
        default=(2048, 512, 32000),
        metavar=("TOKENS", "HIDDEN", "VOCAB"),
        help="linear_cross_entropy shape without CUDA",
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (CPU)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)

    if torch.cuda.is_available():
        report = run_cuda(args.iters)
    else:
        print("no CUDA device: GPU timings need CUDA; measuring linear_cross_entropy memory on CPU only")
        report = run_cpu(*args.cpu_shape, rounds=args.rounds)
    report["environment"] = common.environment()
    try:
        import triton

        report["environment"]["triton"] = triton.__version__
    except ImportError:
        pass
    js, md = common.write(
        Path(args.out) / f"{common.today()}-{common.device_slug()}-kernels", report, _markdown(report)
    )
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
