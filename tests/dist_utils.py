"""Run a function on N CPU processes joined by a gloo process group, with a hard timeout.

`run_distributed(fn, world_size, *args)` spawns the workers; each calls `fn(rank, world_size, *args)` after
`init_process_group`. A worker's exception is re-raised in the test; a hang is killed and fails the test.
`fn` must be defined at module level so the workers can import it.

Workers start from a fork server that has imported torch, spmd and transformers once per test session, so a
launch costs a fork instead of four fresh interpreters importing them (about 8 s per launch on 2 cores). The
server's environment is the session's at its start, so each worker takes the caller's environment as it is
at the launch.
"""

import datetime
import io
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd.layout.mesh import exit_process

HF_MODELING = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "gpt2", "gpt_neox", "opt",
    "granite", "stablelm", "cohere", "olmo", "olmo2", "olmo3", "olmoe", "starcoder2", "mixtral", "qwen2_moe",
    "qwen3_moe", "gpt_oss", "glm", "glm4", "glm4_moe", "ernie4_5_moe", "deepseek_v3", "smollm3", "nemotron",
    "seed_oss", "arcee", "exaone4", "helium", "falcon",
)  # fmt: skip
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.distributed.fsdp",
    "spmd",
    "models",
    "transformers",
    "tests.dist_utils",
    # what a first compile imports (AOTAutograd, its partitioner, inductor's lowering and decompositions, which
    # aot_eager uses too): about 0.5 CPU-seconds per rank of every compiling launch
    "torch._dynamo.backends.debugging",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.compile_fx",
    # every family test_any_model builds: a worker importing them itself paid about 6 s (x4 ranks) per launch
    *(f"transformers.models.{m}.modeling_{m}" for m in HF_MODELING),
]


def _worker(rank: int, fn, world_size: int, port: int, packed: bytes, timeout_s: float, env: dict):
    args = torch.load(io.BytesIO(packed), weights_only=False)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # N processes share a few cores
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_process(0)  # the work is done and checked; gloo's teardown may abort a finalizing interpreter


def run_distributed(fn, world_size: int, *args, timeout_s: float = 120.0):
    # the store's server listens here, on a port the OS picks and holds: a port probed free and bound later
    # by rank 0 could be taken in between by another test run on the machine
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    mp.set_forkserver_preload(PRELOAD)  # a module that fails to import is skipped (and imported by the worker)
    packed = io.BytesIO()
    torch.save(args, packed)  # by value: shared-memory tensors would pass a descriptor each, past the server's limit
    ctx = mp.start_processes(
        _worker,
        args=(fn, world_size, server.port, packed.getvalue(), timeout_s, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world_size} processes did not finish in {timeout_s:.0f}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
