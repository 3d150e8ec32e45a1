"""The torch-native baseline: the same Llama, data, optimizer and schedule as launch.train, laid out the way
torchtitan does it, with no spmd involved.

    torchrun --standalone --nproc-per-node 4 -m benchmarks.native_train --model tiny --mesh fsdp=2,tp=2 --sp \
        --steps 10 --batch-size 8 --seq-len 128 --dtype fp32 --metrics native.jsonl [--compile]

Layout, per spec (mesh dims dp, fsdp, tp; built with init_device_mesh):
  tp > 1     `parallelize_module` with torchtitan's plan: embedding RowwiseParallel, wq/wk/wv/w1/w3
             ColwiseParallel, wo/w2 RowwiseParallel, output ColwiseParallel to vocab-sharded logits and the
             loss under `loss_parallel()`; with sp the norms are SequenceParallel and activations enter the
             attention/MLP through PrepareModuleInput (all-gather) and leave through a reduce-scatter. Each
             attention module sees its local heads (as torchtitan's `view(..., -1, head_dim)` does).
  fsdp > 1   `fully_shard` per block, then the root (HSDP over (dp, fsdp) when dp > 1 too);
             bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).
  dp only    DistributedDataParallel (dp with tp: fully_shard over (dp, fsdp=1), i.e. replicated, as FSDP2 does).
  1 process  plain PyTorch (autocast for bf16), the same as launch.train's single-process path.
The JSONL rows have the trainer's keys; `FILE.jsonl.comm.json` holds the last step's number of collectives.
`comm_bytes` comes from spmd.analysis.record's recorder, the dispatch mode the trainer runs every step under (so both
pay its per-op cost); it sees the collectives that go through the dispatcher (FSDP2's flat all-gathers and
reduce-scatters, DDP's bucket all-reduces, DTensor's), by the same ring convention.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse(argv=None):
    from launch.config import TrainConfig

    d = TrainConfig()  # the trainer's defaults, whatever they are today
    ap = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.native_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mesh", default="")
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--dtype", default=d.dtype, choices=["fp32", "bf16"])
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup, help="learning-rate warmup steps")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--data", default=d.data)
    ap.add_argument("--metrics", default="")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (before fully_shard)")
    ap.add_argument("--kernels", default="", help="override the model's kernels setting (auto|torch|triton)")
    ap.add_argument("--no-record-comm", action="store_true", help="do not run steps under the comm recorder")
    return ap.parse_args(argv)


def _local_attention_cfg(model, tp: int):
    """Each rank's attention computes its own heads: a config with dim, heads and kv heads divided by tp
    (head_dim stays the same)."""
    for block in model.layers:
        cfg = block.attention.cfg
        block.attention.cfg = dataclasses.replace(
            cfg, dim=cfg.dim // tp, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp
        )


def apply_tp(model, tp_mesh, sp: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sp else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        root["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, tp_mesh, plan)
    _local_attention_cfg(model, tp_mesh.size())
    if sp and hasattr(model, "block_inputs"):
        # the residual stream is sequence-sharded here; RoPE tables cover the whole sequence (torchtitan
        # slices freqs_cis by the full length too)
        model.block_inputs = lambda h, positions=None: (
            model.rope_cos[: h.shape[1] * tp_mesh.size()],
            model.rope_sin[: h.shape[1] * tp_mesh.size()],
        )


def apply_fsdp(model, mesh, bf16: bool) -> None:
    """FSDP2 as torchtitan applies it: `fully_shard` on each block, then on the root (kept gathered after
    forward); bf16 computes in bf16 and reduces in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def build(args, world: int, device: torch.device):
    from launch.config import TrainConfig
    from models.llama import Llama
    from spmd.layout.mesh import parse_spec

    cfg = TrainConfig(
        model=args.model,
        mesh=args.mesh,
        sp=args.sp,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        dtype=args.dtype,
        data=args.data,
        seed=args.seed,
    )
    model_cfg = cfg.model_config()
    if args.kernels:
        model_cfg = dataclasses.replace(model_cfg, kernels=args.kernels)
    torch.manual_seed(cfg.seed)  # the trainer's initialisation, weight for weight
    with torch.device(device):
        model = Llama(model_cfg)
    bf16 = args.dtype == "bf16"
    sizes = parse_spec(args.mesh)[0] if args.mesh else ({"fsdp": world} if world > 1 else {})
    dp, fsdp, tp = sizes.get("dp", 1), sizes.get("fsdp", 1), sizes.get("tp", 1)
    layout, mesh, dp_rank, autocast = "plain", None, 0, bf16
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, fsdp, tp), mesh_dim_names=("dp", "fsdp", "tp"))
        dp_rank = mesh["dp"].get_local_rank() * fsdp + mesh["fsdp"].get_local_rank()
        parts = []
        if tp > 1:
            apply_tp(model, mesh["tp"], args.sp)
            parts.append(f"tp{'+sp' if args.sp else ''} (parallelize_module)")
        if args.compile:
            for i, block in enumerate(model.layers):
                model.layers.register_module(str(i), torch.compile(block))
        if fsdp > 1 or (dp > 1 and tp > 1):
            apply_fsdp(model, mesh["dp", "fsdp"] if dp > 1 else mesh["fsdp"], bf16)
            parts.append(("HSDP" if dp > 1 else "FSDP2") + " (fully_shard)")
            autocast = False
        elif dp > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
            parts.append("DDP")
        layout = " + ".join(parts)
    elif args.compile:
        for i, block in enumerate(model.layers):
            model.layers.register_module(str(i), torch.compile(block))
    return cfg, model_cfg, model, mesh, dp_rank, dp * fsdp, tp, layout, autocast


def clip_(params, max_norm: float):
    """Global-norm clipping over DTensor and plain gradients alike (TP without sp leaves norms plain)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault(g.device_mesh, []).append(g)
    pl = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.zeros((), device=grads[0].device if grads else "cpu")
    for group in by_mesh.values():  # norms over tp stay 1-D DTensors under fsdp x tp: one reduction per mesh
        n = torch.nn.utils.get_total_norm(group, foreach=None)
        sq = sq + n.full_tensor().float() ** 2
    if pl:
        sq = sq + torch.nn.utils.get_total_norm(pl, foreach=None).float() ** 2
    total = sq.sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


def main(argv=None) -> int:
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    args = parse(argv)
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from launch import schedule
    from launch.data import build_loader
    from launch.metrics import MetricsLogger, flops_per_token, peak_flops, peak_mem_bytes
    from launch.setup import adamw
    from spmd.analysis.record import CollectiveRecorder

    cfg, model_cfg, model, mesh, dp_rank, dp_size, tp, layout, autocast = build(args, world, device)
    opt = adamw(model, cfg)
    loader, _ = build_loader(cfg, dp_rank, dp_size, model_cfg.vocab_size, device)
    peak, source = peak_flops(cfg.dtype, device) if rank == 0 else (0.0, "")
    metrics = MetricsLogger(
        cfg.steps,
        cfg.batch_size * cfg.seq_len,
        flops_per_token(model_cfg, cfg.seq_len),
        peak,
        world,
        args.metrics,
        enabled=rank == 0,
        console=False,
    )
    if rank == 0:
        print(
            f"[native_train] {args.model} {layout or 'plain'} on {world} {device.type} process(es), "
            f"{cfg.batch_size}x{cfg.seq_len}, {cfg.dtype}{', compiled blocks' if args.compile else ''}",
            flush=True,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(cfg.steps):
        schedule.set_lr(opt, schedule.lr_at(step, cfg.lr, cfg.warmup, cfg.steps))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        ((x, y),) = loader.next()
        recorder = CollectiveRecorder(mesh) if (mesh is not None and not args.no_record_comm) else None
        amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with recorder or contextlib.nullcontext():
            with amp:
                if tp > 1:
                    from torch.distributed.tensor.parallel import loss_parallel

                    with loss_parallel():
                        logits = model(x)
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                        loss.backward()
                else:
                    loss = model(x, y)
            if tp <= 1:
                loss.backward()
            norm = clip_(params, cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        loss_value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)  # waits for the device
        dt = time.perf_counter() - t0
        if dp_size > 1:  # the global mean loss, as the trainer reports it (outside the timed step)
            t = torch.tensor([loss_value], device=device)
            dist.all_reduce(t)
            loss_value = float(t) / world
        comm = sum(r.bytes for r in recorder.records) if recorder is not None else 0
        metrics.record(step + 1, loss_value, float(norm), opt.param_groups[0]["lr"], dt, peak_mem_bytes(device), comm)
    metrics.close()
    if rank == 0 and args.metrics and recorder is not None:
        # sidecar: how many collectives the last step issued (that the dispatch-mode recorder sees), by kind
        import json
        from collections import Counter

        with open(args.metrics + ".comm.json", "w") as f:
            json.dump(
                {
                    "collectives_per_step": len(recorder.records),
                    "bytes_per_step": comm,
                    "by_kind": Counter(r.kind for r in recorder.records),
                },
                f,
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmd.layout.mesh import exit_process

    exit_process(main())  # not sys.exit: see exit_process
