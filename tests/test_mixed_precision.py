"""bf16 compute with fp32 master weights, several AdamW steps, on dp, fsdp, tp with sp, cp, pp and ep, against one
process running the same mixed-precision recipe in plain PyTorch.

The recipe (`reference`, no spmd): the fp32 master model is copied to bf16 for each step's forward and
backward; each data-parallel slice of the batch (each micro-batch under pp) runs on that bf16 copy, and its
bf16 gradients are cast to fp32 and summed in fp32; AdamW (fused, the trainer's) steps the fp32 masters. spmd runs it as
`parallelize(..., param_dtype=torch.bfloat16)` (reduce_dtype fp32) with `master="params"` (fp32 parameters,
cast when gathered) and `master="optimizer"` (bf16 parameters, the fp32 master with AdamW, through
spmd.shard_optimizer; its masters start from the bf16-rounded initial weights, and so do the recipe's),
STEPS steps on each of SPECS and on `pp=2,fsdp=2`, all in one 4-process launch (fsdp=4 and the pipeline's
micro-batches slice the batch alike, so they share a recipe).

Tolerances, from bf16's machine epsilon EPS = 2^-8 (each bf16 rounding moves a value by at most EPS/2 of
itself; a tensor rounded elementwise moves by ~EPS/(2*sqrt(3)) in relative norm):
- loss and gradients, checked before each step, relative norm <= GRAD_TOL = 4 EPS: the sharded run rounds to
  bf16 at other points than one device (a row-parallel matmul rounds each partial sum, ring attention each
  block) and the gradient passes through a few roundings per layer;
- the fp32 masters after each step, relative norm <= MASTER_TOL = EPS / 16, under a quarter of what rounding
  the masters to bf16 once costs. The learning rate LR = 1e-5 keeps a step's change of a parameter (std 0.02) below
  bf16's spacing there (2^-13 ~ 1.2e-4), as real training's updates are: only fp32 masters hold it; masters
  destroyed by a bf16 round trip miss it by more than MASTER_TOL, on every spec.

Measured (max over specs, both masters, steps and tensors): loss 2.2e-5, gradients 1.08e-2 (fsdp=2,tp=2,sp;
7.6e-3 on fsdp=4), masters 9.4e-5 (MASTER_TOL 2.4e-4); with the masters rounded to bf16 at each gather (the
mutation below) the masters exceed MASTER_TOL on fsdp=4.

Expert parallelism (`ep=2,tp=2`) runs the MoE model with a router given a margin. Routing is discontinuous:
with moe-tiny's random router, bf16 rounding that differs from the recipe's flips some tokens' top-k experts
(on one process already, bf16 against fp32 routes different tokens), and the experts' gradients then differ by
0.07 to 0.12, far above GRAD_TOL. So `routed_with_margin` writes each token's two experts into its embedding
(two of the first n_experts dims set to 1, the rest of those dims 0) and makes the router read those dims
(4 x identity): a token's two chosen logits stand about 4/rms(h) above the others, while bf16 moves a logit
(|logit| <= ~20) by ~2^-8 of itself. The recipe's run asserts the least gap between a token's k-th and
(k+1)-th logit, over every token, layer and step, stays above ROUTING_MARGIN (measured: 20.9), many times what
two bf16 computations of a logit can differ by (< 0.2): the routing cannot flip, so the test measures the
arithmetic alone. Its gradients are held to GRAD_TOL_MOE = 16 EPS: each expert computes on the ~32 tokens
routed to it and its output is scaled by a bf16 gate, so the recipe's own bf16 gradients are 3.9e-2 from fp32
on this model (1.1e-2 on Llama, which GRAD_TOL = 4 EPS holds), and two bf16 runs rounding at other points
differ by as much: measured 4.9e-2 (experts, embedding). A flipped token costs 7e-2 to 1.2e-1, a wrong
reduction far more. Losses and masters keep GRAD_TOL and MASTER_TOL (measured 6.5e-5 and 1.7e-4).

Kills (tests/mutants.py): `ParamGroup.issue` copying the bf16-rounded values back into the fp32 parameters, which
`test_lean_path.py`'s one-step cast test did not notice.
"""

import copy
import time

import torch
import torch.distributed as dist

import models
import spmd
from spmd.layout.sequence import cp_slice
from tests.dist_utils import run_distributed
from tests.spmd_cases import BATCH, global_batch, norm_rel_errs, tiny_model

EPS = 2.0**-8
GRAD_TOL = 4 * EPS
GRAD_TOL_MOE = 16 * EPS  # see the module docstring: one process's bf16 run is itself 3.9e-2 from fp32 there
MASTER_TOL = EPS / 16
LR, STEPS, MICROBATCHES = 1e-5, 5, 2
SPECS = {
    "fsdp=4": "llama",
    "dp=2,fsdp=2": "llama",
    "fsdp=2,tp=2,sp": "llama",
    "fsdp=2,cp=2": "llama",
    "ep=2,tp=2": "moe",
}
ROUTING_MARGIN = 4.0  # least router-logit gap between a token's k-th and (k+1)-th expert, in the recipe's bf16 run
PIPELINED = "pp=2,fsdp=2"
MASTERS = ("params", "optimizer")


def build(kind: str):
    assert kind in ("llama", "moe"), kind
    return tiny_model() if kind == "llama" else routed_with_margin()


def routed_with_margin():
    """moe-tiny whose routing bf16 cannot flip (module docstring): token t's experts are t % E and another
    one picked by t // E, written into the first E embedding dims, which the router reads."""
    torch.manual_seed(0)
    model = models.preset("moe-tiny", kernels="torch").build()
    n = model.cfg.n_experts
    t = torch.arange(model.cfg.vocab_size)
    with torch.no_grad():
        emb = model.tok_embeddings.weight
        emb[:, :n] = 0.0
        emb[t, t % n] = 1.0
        emb[t, (t + 1 + (t // n) % (n - 1)) % n] = 1.0
        for layer in model.layers:
            router = layer.feed_forward.router.weight
            router.zero_()
            router[:, :n] = 4 * torch.eye(n)
    return model


def _routing_gaps(model, gaps: list):
    """Hooks that append each router call's least gap between a token's k-th and (k+1)-th logit."""
    layers = getattr(model, "layers", [])
    k = getattr(model.cfg, "top_k", 0)

    def hook(module, args, out):
        top = out.float().topk(k + 1, dim=-1).values
        gaps.append((top[..., k - 1] - top[..., k]).min().item())

    return [layer.feed_forward.router.register_forward_hook(hook) for layer in layers if k]


def _pieces(spec: str, kind: str) -> list[torch.Tensor]:
    """Rows of the global batch that one backward of the spmd run computes: a data-parallel slice, or under pp
    piece m of every slice (micro-batch m)."""
    sizes = spmd.parse_spec(spec)[0]
    n = spmd.Rules.default().data_parallel_size(sizes)
    per = BATCH // n
    if "pp" not in sizes:
        return [torch.arange(r * per, (r + 1) * per) for r in range(n)]
    piece = per // MICROBATCHES
    return [torch.arange(r * per + m * piece, r * per + (m + 1) * piece) for r in range(n) for m in range(MICROBATCHES)]


def reference(kind: str, pieces: list[torch.Tensor], master_in_optimizer: bool) -> list[dict]:
    """The mixed-precision recipe in plain PyTorch: per step the loss, the fp32 gradients and the updated fp32
    masters. With the master in the optimizer the parameters are stored in bf16, so the masters start from the
    bf16-rounded initial weights (as DeepSpeed's, made from the model once it is cast)."""
    master = build(kind)
    if master_in_optimizer:
        with torch.no_grad():
            for p in master.parameters():
                p.copy_(p.to(torch.bfloat16))
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.1, fused=True)
    out = []
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        low = copy.deepcopy(master).to(torch.bfloat16)  # the compute copy
        gaps, loss = [], 0.0
        _routing_gaps(low, gaps)
        for rows in pieces:
            part = low(tokens[rows], targets[rows]) / len(pieces)
            part.backward()
            loss += part.item()
            for p, q in zip(master.parameters(), low.parameters()):
                g = q.grad.float()  # summed over the slices in fp32
                p.grad = g if p.grad is None else p.grad + g
                q.grad = None
        assert min(gaps, default=ROUTING_MARGIN) >= ROUTING_MARGIN, (kind, step, min(gaps))  # routing cannot flip
        grads = {n: p.grad.clone() for n, p in master.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append(dict(loss=loss, grads=grads, masters={n: p.detach().clone() for n, p in master.named_parameters()}))
    return out


def _layout(spec: str, kind: str, master: str):
    """(model or pipeline, step(tokens, targets) -> loss after backward)."""
    sizes, flags = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    rules = spmd.Rules.default(sequence_parallel="sp" in flags)
    if "pp" in sizes:
        pipe = spmd.build_pipeline(
            build(kind),
            mesh,
            rules,
            schedule="1f1b",
            microbatches=MICROBATCHES,
            param_dtype=torch.bfloat16,
            master=master,
        )
        data = pipe.stage_mesh
        return pipe, lambda x, y: pipe.step(_data_slice(x, data, rules), _data_slice(y, data, rules))
    model = spmd.parallelize(build(kind), mesh, rules, param_dtype=torch.bfloat16, master=master)

    def step(tokens, targets):
        x, y = _data_slice(tokens, mesh, rules), _data_slice(targets, mesh, rules)
        extra = ()
        if "cp" in sizes:
            extra = (cp_slice(torch.arange(x.shape[1]).expand_as(x), mesh),)
            x, y = cp_slice(x, mesh), cp_slice(y, mesh)
        loss = model(x, y, *extra)
        loss.backward()
        return loss

    return model, step


def _data_slice(t, mesh, rules):
    n, r = rules.data_parallel_size(mesh), rules.data_parallel_rank(mesh)
    b = t.shape[0] // n
    return t[r * b : (r + 1) * b]


def _train_and_compare(spec: str, kind: str, master: str, ref: list[dict]) -> dict:
    """STEPS steps of `spec`; asserts loss and gradients (before each step) within GRAD_TOL and the fp32
    masters (after it) within MASTER_TOL of the recipe's; returns the largest errors seen."""
    model, train_step = _layout(spec, kind, master)
    grad_tol = GRAD_TOL_MOE if kind == "moe" else GRAD_TOL
    opt = spmd.shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True))
    names = {id(p): n for n, p in model.named_parameters()}
    worst = {"loss": 0.0, "grads": 0.0, "masters": 0.0}
    for step, want in enumerate(ref):
        loss = train_step(*global_batch(step)).item()
        spmd.reduce_gradients(model)
        worst["loss"] = max(worst["loss"], abs(loss - want["loss"]) / abs(want["loss"]))
        assert worst["loss"] <= GRAD_TOL, (spec, master, step, loss, want["loss"])
        for name, p in model.named_parameters():
            assert p.dtype == (torch.float32 if master == "params" else torch.bfloat16), (name, p.dtype)
        grads = norm_rel_errs([(n, p.grad, want["grads"][n]) for n, p in model.named_parameters()])
        for name, err in grads.items():
            worst["grads"] = max(worst["grads"], err)
            assert err <= grad_tol, f"{spec} master={master} step {step}: gradient of {name} off by {err:.2e}"
        opt.step()
        opt.zero_grad()
        masters = [
            (names[id(getattr(m, "_spmd_master_of", m))], m) for group in opt.param_groups for m in group["params"]
        ]
        for name, m in masters:
            assert m.dtype == torch.float32, (name, m.dtype)
        for name, err in norm_rel_errs([(n, m, want["masters"][n]) for n, m in masters]).items():
            worst["masters"] = max(worst["masters"], err)
            assert err <= MASTER_TOL, f"{spec} master={master} step {step}: master of {name} off by {err:.2e}"
    return worst


def _all_runs(rank, world, runs, references):
    for spec, kind in runs:
        for master in MASTERS:
            start = time.perf_counter()
            worst = _train_and_compare(spec, kind, master, references[spec, master])
            if rank == 0:
                print(
                    f"{spec} master={master}: "
                    + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
                    + f" ({time.perf_counter() - start:.1f} s)",
                    flush=True,
                )
    dist.barrier()


def test_bf16_with_fp32_masters_trains_as_the_recipe_on_one_process():
    runs = [*SPECS.items(), (PIPELINED, "llama")]
    recipes = {}  # the recipe depends on the model, the slices and where the master starts
    for spec, kind in runs:
        for master in MASTERS:
            pieces = _pieces(spec, kind)
            key = (kind, len(pieces), master)
            if key not in recipes:
                recipes[key] = reference(kind, pieces, master == "optimizer")
    references = {
        (spec, master): recipes[kind, len(_pieces(spec, kind)), master] for spec, kind in runs for master in MASTERS
    }
    run_distributed(_all_runs, 4, runs, references, timeout_s=400)
