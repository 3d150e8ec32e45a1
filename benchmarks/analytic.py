"""The analytic model: communication and model-state bytes per rank per step, from the textbook formulas.

Pure functions of a model config (anything with LlamaConfig's fields), a spec (mesh sizes + `sp`), the
global batch and the compute dtype. No torch.distributed, no tensors. `spmd.explain` and real runs are
checked against it (benchmarks/compare_comm.py, tests/test_analytic.py).

Conventions (those of spmd.analysis.record and shared/DESIGN.md): bytes are per rank, on the wire, for ring
algorithms: all-gather and reduce-scatter of a full tensor of S bytes over n ranks move S(n-1)/n,
all-reduce 2S(n-1)/n. Every collective is rounded down to whole bytes, as the recorder rounds it.

The textbook terms, and the terms the textbooks leave out that a real step has (each its own line):

  Megatron TP, per block       8 * S * (t-1)/t, S = b*s*h*e  (b local batch, s seq, h dim, e bytes of the
                               compute dtype): 2 all-reduces forward + 2 backward of S; with sequence
                               parallelism each all-reduce is an all-gather + a reduce-scatter (same bytes)
  TP outside the blocks        4 * S * (t-1)/t: the vocab-parallel embedding's forward all-reduce and the
                               output projection's backward all-reduce (SP: reduce-scatter + all-gather each)
  vocab-parallel loss          over tp: all-reduce of the row max (N fp32) and of (sum exp, target logit)
                               (2N fp32), N = b*s local tokens; over the data axes (dp and fsdp of size > 1,
                               one flattened group): all-reduce of (loss sum, token count), 2 fp32
  SP norm-weight gradients     sequence-sharded RMSNorms see different tokens per tp rank: each norm weight's
                               gradient (h fp32, its fsdp shard) is all-reduced over tp (with dp: over the
                               flattened dp x tp group); 2 per block + final
  ZeRO-3 / FSDP over n         all-gather forward (Ψ), all-gather again for backward (Ψ), reduce-scatter of
                               gradients (Ψ): "3Ψ"; Ψ is the tp-local parameter bytes. Mixed precision: gathers
                               move the compute dtype, gradient reductions fp32 (our trainer's policy). One
                               gather per unit (each block, the root, a tied weight); the root (embedding,
                               final norm, output) stays gathered for backward, as FSDP2's root does, so
                               backward regathers Ψ minus the root
  DP over d                    all-reduce of the gradients (fp32; of the fsdp shard under HSDP): "2Ψ"
  gradient buffers             gradients with the same reduction (a reduce-scatter over fsdp, then one all-
                               reduce over the other axes they are summed over) share buffers across blocks,
                               issued at bucket_mb (DDP's 25 MB), the first at 1 MB (DDP's first bucket); a tied
                               weight reduces on its own
  EP over ep (expert_comm)     a mixture of experts at balanced routing: 4 all-to-alls per MoE layer of
                               top_k*b*s*h*e (ep-1)/ep, the token counts, the router statistics; its expert
                               parameters per rank: expert_states. The dense terms under ep are not modelled

Model states (ZeRO paper, Adam): `zero_model_states` gives DESIGN.md's formulas (mixed precision K=12: DP 16Ψ,
ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N; fp32: 4Ψ+4Ψ+8Ψ). `model_states` gives what our layout holds:
fp32 master parameters, fp32 gradients and two fp32 Adam states per parameter, each sharded as the spec
shards its parameter (fsdp on `embed`, tp on heads/mlp/vocab, norms whole over tp, dp replicates) - in
bf16 too, since the trainer keeps fp32 masters and casts when it gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
REDUCE_BYTES = 4  # gradients are reduced in fp32
DEFAULT_BUCKET_MB = 25.0  # spmd.runtime.gradients.reducer's (DDP's) gradient buffer
FIRST_BUCKET_MB = 1.0  # and its first buffer of a backward (DDP's first bucket)
LOSS_BYTES = 4  # the loss statistics are fp32


@dataclass(frozen=True)
class Spec:
    """Mesh sizes and flags: `Spec.parse("fsdp=2,tp=2,sp")`."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False

    @classmethod
    def parse(cls, text: str) -> Spec:
        sizes, flags = {}, set()
        for part in (p.strip() for p in text.replace("+", ",").split(",")):
            if not part:
                continue
            if "=" in part:
                k, _, v = part.partition("=")
                sizes[k.strip()] = int(v)
            else:
                flags.add(part)
        unknown = set(sizes) - {"dp", "fsdp", "tp", "pp", "ep"} or flags - {"sp"}
        if unknown:
            raise ValueError(f"spec {text!r}: unknown axes or flags {sorted(unknown)}")
        return cls(**sizes, sp="sp" in flags)

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.ep * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """Ranks the batch is split over: ep splits it too (expert parallelism as DeepSpeed-MoE lays it out)."""
        return self.dp * self.fsdp * self.ep

    @property
    def sizes(self) -> dict:
        return {"pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "ep": self.ep, "tp": self.tp}

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    def __str__(self) -> str:
        parts = [f"{a}={s}" for a, s in self.sizes.items() if s > 1] or ["dp=1"]
        return ",".join(parts) + (",sp" if self.sp and self.tp > 1 else "")


def ring(kind: str, full_bytes: int, n: int) -> int:
    """Per-rank wire bytes of one collective on a full tensor of `full_bytes` over `n` ranks."""
    if n <= 1:
        return 0
    return (2 if kind == "all_reduce" else 1) * full_bytes * (n - 1) // n


# ----------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    tp_sharded: bool  # heads/kv_heads/mlp/vocab dim split over tp (norm weights are not)
    role: str  # "embedding" | "output" | "tied" (an embedding that is also the output) | "block" | "norm"


def parameters(cfg) -> list[Param]:
    """The Llama parameters by role, as models/llama.py builds them (a tied output is the embedding)."""
    d, hd = cfg.dim, cfg.dim // cfg.n_heads
    out = [Param("tok_embeddings.weight", cfg.vocab_size * d, True, "tied" if cfg.tie_embeddings else "embedding")]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out += [
            Param(p + "attention_norm.weight", d, False, "norm"),
            Param(p + "attention.wq.weight", cfg.n_heads * hd * d, True, "block"),
            Param(p + "attention.wk.weight", cfg.n_kv_heads * hd * d, True, "block"),
            Param(p + "attention.wv.weight", cfg.n_kv_heads * hd * d, True, "block"),
            Param(p + "attention.wo.weight", cfg.n_heads * hd * d, True, "block"),
            Param(p + "ffn_norm.weight", d, False, "norm"),
            Param(p + "feed_forward.w1.weight", cfg.ffn_dim * d, True, "block"),
            Param(p + "feed_forward.w3.weight", cfg.ffn_dim * d, True, "block"),
            Param(p + "feed_forward.w2.weight", cfg.ffn_dim * d, True, "block"),
        ]
    out.append(Param("norm.weight", d, False, "norm"))
    if not cfg.tie_embeddings:
        out.append(Param("output.weight", cfg.vocab_size * d, True, "output"))
    return out


def parameter_units(params: list[Param], tied: bool = False) -> dict:
    """The units spmd gathers in one buffer each (spmd/runtime/parameters/buckets.py): every block, the root (the
    parameters outside the blocks, gathered once and kept for backward as FSDP2's root), and a tied weight on
    its own (two modules use it). Keys in forward order."""
    units: dict[str, list] = {"root": []}
    for p in params:
        key = p.name.split(".")[1] if p.name.startswith("layers.") else ("tied" if p.role == "tied" else "root")
        units.setdefault(key, []).append(p)
    return units


def buffers(params: list[Param], nbytes, bucket_mb: float) -> list[int]:
    """Bytes of each gradient buffer spmd.runtime.gradients.reducer issues: gradients arrive block by block in backward
    order (the last block first, the root last) and a buffer goes out as soon as it holds `bucket_mb` MB, the
    first one at FIRST_BUCKET_MB (DDP's first bucket) already."""
    units = list(parameter_units(params).items())
    order = [u for k, u in reversed(units) if k.isdigit()] + [u for k, u in units if not k.isdigit()]
    cap, out, open_ = int(bucket_mb * 2**20), [], 0
    for unit in order:
        for p in unit:
            open_ += nbytes(p)
            if open_ >= (cap if out else min(cap, int(FIRST_BUCKET_MB * 2**20))):
                out.append(open_)
                open_ = 0
    return out + ([open_] if open_ else [])


def gradient_reductions(params: list[Param], spec: Spec) -> dict:
    """{(reduce-scatter axis or None, all-reduce axes): parameters} as spmd.runtime.gradients.reducer groups them: a
    gradient is summed over the data axes (and over tp too for a sequence-parallel norm weight); it is
    reduce-scattered over fsdp, which shards every parameter, then all-reduced over the other axes as one
    flattened group. A tied weight is left out (it reduces on its own)."""
    out: dict = {}
    for p in params:
        if p.role == "tied":
            continue
        summed = (("dp",) if spec.dp > 1 else ()) + (
            ("tp",) if spec.sequence_parallel and spec.tp > 1 and p.role == "norm" else ()
        )
        key = ("fsdp" if spec.fsdp > 1 else None, summed)
        if key != (None, ()):
            out.setdefault(key, []).append(p)
    return out


def tp_local(p: Param, spec: Spec) -> int:
    return p.numel // spec.tp if p.tp_sharded else p.numel


def local_numel(p: Param, spec: Spec) -> int:
    """Elements of `p` this rank stores: every parameter has `embed`, sharded over fsdp."""
    return tp_local(p, spec) // spec.fsdp


# ------------------------------------------------------------------------------------- communication
@dataclass
class Term:
    """One line of the model: which collectives, over which axis, in which phase, how many, how many bytes."""

    name: str
    axis: str
    kinds: tuple
    phase: str
    count: int
    bytes: int
    textbook: bool  # part of the Megatron/ZeRO formulas as DESIGN.md states them
    formula: str = ""


@dataclass
class CommModel:
    spec: Spec
    batch: int
    seq: int
    dtype: str
    terms: list = field(default_factory=list)

    def total(self, textbook_only: bool = False) -> int:
        return sum(t.bytes for t in self.terms if t.textbook or not textbook_only)

    def by_axis(self) -> dict:
        out: dict[str, int] = {}
        for t in self.terms:
            out[t.axis] = out.get(t.axis, 0) + t.bytes
        return out

    def by(self, *fields_) -> dict:
        out: dict[tuple, int] = {}
        for t in self.terms:
            key = tuple(getattr(t, f) for f in fields_)
            out[key] = out.get(key, 0) + t.bytes
        return out

    def count(self) -> int:
        return sum(t.count for t in self.terms)

    def to_dict(self) -> dict:
        return {
            "spec": str(self.spec),
            "batch": self.batch,
            "seq": self.seq,
            "dtype": self.dtype,
            "total": self.total(),
            "textbook": self.total(textbook_only=True),
            "collectives": self.count(),
            "terms": [t.__dict__ | {"kinds": list(t.kinds)} for t in self.terms if t.count],
        }


def comm(
    cfg, spec: Spec | str, batch: int, seq: int, dtype: str = "fp32", bucket_mb: float = DEFAULT_BUCKET_MB
) -> CommModel:
    """Expected collectives of one training step (forward + backward + gradient reduction) per rank."""
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    if spec.pp > 1:
        raise NotImplementedError("pipeline parallelism is not in the analytic model yet")
    if spec.ep > 1:
        raise NotImplementedError("under ep only the expert-parallel traffic is modelled: expert_comm")
    if batch % spec.data_parallel:
        raise ValueError(f"batch {batch} does not divide by dp*fsdp={spec.data_parallel}")
    e = BYTES[dtype]
    t, n, d = spec.tp, spec.fsdp, spec.dp
    b = batch // spec.data_parallel
    L, h = cfg.n_layers, cfg.dim
    S = b * seq * h * e  # one residual-stream activation of this rank's batch
    N = b * seq  # this rank's tokens
    m = CommModel(spec, batch, seq, dtype)
    add = m.terms.append

    if t > 1:
        if spec.sequence_parallel:
            add(
                Term(
                    "TP blocks (Megatron, SP)",
                    "tp",
                    ("all_gather", "reduce_scatter"),
                    "forward+backward",
                    8 * L,
                    8 * L * ring("all_gather", S, t),
                    True,
                    "L * 8 * S(t-1)/t as 4 AG + 4 RS",
                )
            )
            add(
                Term(
                    "TP embedding + output (SP)",
                    "tp",
                    ("reduce_scatter", "all_gather"),
                    "forward+backward",
                    4,
                    4 * ring("all_gather", S, t),
                    False,
                    "embedding RS fwd + AG bwd; output AG fwd + RS bwd",
                )
            )
        else:
            add(
                Term(
                    "TP blocks (Megatron)",
                    "tp",
                    ("all_reduce",),
                    "forward+backward",
                    4 * L,
                    4 * L * ring("all_reduce", S, t),
                    True,
                    "L * 8 * S(t-1)/t as 4 AR",
                )
            )
            add(
                Term(
                    "TP embedding + output",
                    "tp",
                    ("all_reduce",),
                    "forward+backward",
                    2,
                    2 * ring("all_reduce", S, t),
                    False,
                    "embedding AR fwd + output AR bwd",
                )
            )
        add(
            Term(
                "vocab-parallel loss over tp",
                "tp",
                ("all_reduce",),
                "forward",
                2,
                ring("all_reduce", N * LOSS_BYTES, t) + ring("all_reduce", 2 * N * LOSS_BYTES, t),
                False,
                "AR of row max (N fp32) + AR of (sum exp, target logit) (2N fp32)",
            )
        )
    data = [a for a, size in (("dp", d), ("fsdp", n)) if size > 1]
    if data:
        add(
            Term(
                "loss mean over the data axes",
                "+".join(data),
                ("all_reduce",),
                "forward",
                1,
                ring("all_reduce", 2 * LOSS_BYTES, d * n),
                False,
                "AR of (loss sum, count), 2 fp32, over the flattened group of dp and fsdp",
            )
        )

    params = parameters(cfg)
    units = parameter_units(params, cfg.tie_embeddings)
    if n > 1:

        def gathered(unit):
            return ring("all_gather", sum(tp_local(p, spec) for p in unit) * e, n)

        fwd = sum(gathered(u) for u in units.values())
        add(
            Term(
                "FSDP all-gather forward",
                "fsdp",
                ("all_gather",),
                "forward",
                len(units),
                fwd,
                True,
                "Ψ(n-1)/n, compute dtype, one per unit (each block, the root, a tied weight)",
            )
        )
        add(Term("FSDP all-gather backward", "fsdp", ("all_gather",), "backward", len(units), fwd, True, "Ψ(n-1)/n"))
        add(
            Term(
                "FSDP root unit kept gathered for backward",
                "fsdp",
                ("all_gather",),
                "backward",
                -1,
                -gathered(units["root"]),
                False,
                "-Ψ_root(n-1)/n (FSDP2's root: embedding, final norm, output)",
            )
        )
    sizes = {"dp": d, "fsdp": n, "tp": t}
    for (scatter, summed), members in gradient_reductions(params, spec).items():
        bufs = buffers(members, lambda p: tp_local(p, spec) * REDUCE_BYTES, bucket_mb)
        norms = members[0].role == "norm" and "tp" in summed
        what = ", sequence-parallel norms" if norms else ""
        if scatter:
            add(
                Term(
                    f"FSDP gradient reduce-scatter{what}",
                    "fsdp",
                    ("reduce_scatter",),
                    "backward",
                    len(bufs),
                    sum(ring("reduce_scatter", b, n) for b in bufs),
                    True,
                    f"Ψ(n-1)/n, fp32, in {bucket_mb:g} MB buffers across blocks",
                )
            )
        if summed:
            group = math.prod(sizes[a] for a in summed)
            add(
                Term(
                    "SP norm-weight gradients" if norms else "DP gradient all-reduce",
                    "+".join(summed),
                    ("all_reduce",),
                    "backward",
                    len(bufs),
                    sum(ring("all_reduce", b // n, group) for b in bufs),
                    not norms,
                    f"2Ψ(g-1)/g over the {' x '.join(summed)} group, fp32"
                    + (", of the fsdp shard" if scatter else "")
                    + f", in {bucket_mb:g} MB buffers across blocks",
                )
            )
    for p in params:
        if p.role == "tied":  # used by two modules: reduced on its own, axis by axis
            if n > 1:
                add(
                    Term(
                        "FSDP gradient reduce-scatter, tied weight",
                        "fsdp",
                        ("reduce_scatter",),
                        "backward",
                        1,
                        ring("reduce_scatter", tp_local(p, spec) * REDUCE_BYTES, n),
                        True,
                        "fp32",
                    )
                )
            if d > 1:
                add(
                    Term(
                        "DP gradient all-reduce, tied weight",
                        "dp",
                        ("all_reduce",),
                        "backward",
                        1,
                        ring("all_reduce", tp_local(p, spec) * REDUCE_BYTES // n, d),
                        True,
                        "fp32",
                    )
                )
    return m


def expert_comm(cfg, spec: Spec | str, batch: int, seq: int, dtype: str = "fp32") -> CommModel:
    """A mixture of experts' own traffic per rank per step at balanced routing (each expert gets an equal share
    of each rank's tokens): per MoE layer the dispatch and combine all-to-alls forward and their mirrors in
    backward, each top_k*b*s*h*e*(ep-1)/ep (DESIGN.md), and the forward exchange of the E token counts
    (int64); the router statistics of the load-balancing loss (f_e and P_e, E fp32 each) and of the z-loss
    (1 fp32) are all-reduced over every data axis."""
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    L, E, ep = cfg.n_layers, cfg.n_experts, spec.ep
    S = cfg.top_k * batch // spec.data_parallel * seq * cfg.dim * BYTES[dtype]  # this rank's routed rows
    m = CommModel(spec, batch, seq, dtype)
    if ep > 1:
        m.terms += [
            Term(
                "EP dispatch + combine",
                "ep",
                ("all_to_all",),
                "forward+backward",
                4 * L,
                4 * L * (S * (ep - 1) // ep),
                True,
                "4L * top_k*b*s*h*e (ep-1)/ep",
            ),
            Term(
                "EP token counts",
                "ep",
                ("all_to_all",),
                "forward",
                L,
                L * (E * 8 * (ep - 1) // ep),
                False,
                "L * E int64 (ep-1)/ep",
            ),
        ]
    data = {a: size for a, size in (("dp", spec.dp), ("fsdp", spec.fsdp), ("ep", ep)) if size > 1}
    if data:  # DTensor sums over the flattened group of the axes that split the tokens (spmd.parallelize made it)
        size = math.prod(data.values())
        m.terms.append(
            Term(
                "router statistics over the data axes",
                "+".join(data),
                ("all_reduce",),
                "forward",
                3 * L,
                L * (2 * ring("all_reduce", E * LOSS_BYTES, size) + ring("all_reduce", LOSS_BYTES, size)),
                False,
                "L * AR of f_e, P_e (E fp32 each) and of the z-loss (1 fp32)",
            )
        )
    return m


def expert_states(cfg, spec: Spec | str) -> int:
    """Bytes of expert parameters per rank (fp32): E/ep experts of 3 * expert_dim * dim per MoE layer, mlp split
    over tp and embed over fsdp."""
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    return 4 * cfg.n_layers * cfg.n_experts // spec.ep * 3 * cfg.expert_dim * cfg.dim // spec.tp // spec.fsdp


def textbook_comm(cfg, spec: Spec | str, batch: int, seq: int, dtype: str = "fp32") -> dict:
    """DESIGN.md's formulas in closed form (no per-tensor rounding): Megatron 8bsh(t-1)/t per block, ZeRO-3 3Ψ,
    DP 2Ψ, with Ψ the tp-local parameter bytes (gathers in the compute dtype, reductions in fp32)."""
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    e = BYTES[dtype]
    t, n, d = spec.tp, spec.fsdp, spec.dp
    b = batch // spec.data_parallel
    psi = sum(tp_local(p, spec) for p in parameters(cfg))
    out = {
        "tp": cfg.n_layers * 8 * b * seq * cfg.dim * e * (t - 1) / t,
        "fsdp": (2 * psi * e + psi * REDUCE_BYTES) * (n - 1) / n,
        "dp": 2 * psi / n * REDUCE_BYTES * (d - 1) / d,
    }
    out["total"] = sum(out.values())
    return out


# -------------------------------------------------------------------------------------- model states
def model_states(cfg, spec: Spec | str, optimizer: str = "adamw") -> dict:
    """Bytes per rank of fp32 parameters, fp32 gradients and fp32 optimizer states, sharded as the spec
    shards each parameter (spmd's layout; bf16 compute keeps fp32 masters, so the same in bf16)."""
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    local = sum(local_numel(p, spec) for p in parameters(cfg))
    states = {"adamw": 2, "adam": 2, "sgd": 0}[optimizer]
    out = {"parameters": 4 * local, "gradients": 4 * local, "optimizer": 4 * states * local}
    out["total"] = sum(out.values())
    return out


def zero_model_states(psi: int, n: int, stage: int, mixed_precision: bool = True) -> float:
    """Model-state bytes per rank for Ψ parameters over n data-parallel ranks with Adam (ZeRO paper):
    mixed precision (K=12): stage 0 (DP) 16Ψ, 1: 4Ψ+12Ψ/N, 2: 2Ψ+14Ψ/N, 3: 16Ψ/N. fp32: params 4Ψ,
    grads 4Ψ, states 8Ψ, stage 1 shards states, 2 also grads, 3 also params."""
    if mixed_precision:
        p, g, s = 2 * psi, 2 * psi, 12 * psi
    else:
        p, g, s = 4 * psi, 4 * psi, 8 * psi
    return (p / n if stage >= 3 else p) + (g / n if stage >= 2 else g) + (s / n if stage >= 1 else s)


def summary(cfg, spec: Spec | str, batch: int, seq: int, dtype: str = "fp32") -> dict:
    spec = Spec.parse(spec) if isinstance(spec, str) else spec
    if getattr(cfg, "n_experts", 0):
        return {
            "spec": str(spec),
            "expert_comm": expert_comm(cfg, spec, batch, seq, dtype).to_dict(),
            "expert_parameters": expert_states(cfg, spec),
            "flops_per_rank": cfg.flops_per_token(seq) * batch * seq / spec.world,
        }
    c = comm(cfg, spec, batch, seq, dtype)
    return {
        "spec": str(spec),
        "comm": c.to_dict(),
        "textbook": textbook_comm(cfg, spec, batch, seq, dtype),
        "model_states": model_states(cfg, spec),
        "flops_per_rank": cfg.flops_per_token(seq) * batch * seq / spec.world,
    }


if __name__ == "__main__":
    import argparse
    import json

    import models

    ap = argparse.ArgumentParser(description="analytic comm and model-state bytes per rank per step")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--spec", default="fsdp=2,tp=2,sp")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--dtype", default="fp32")
    a = ap.parse_args()
    print(
        json.dumps(
            summary(models.preset(a.model), a.spec, a.batch, a.seq, a.dtype), indent=1, default=lambda x: math.nan
        )
    )
