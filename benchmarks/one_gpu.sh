#!/bin/bash
# The one-GPU checks, each bounded in time, in the order of their value, every log kept (about 10 minutes):
#   bash benchmarks/one_gpu.sh COMMIT OUTDIR
# COMMIT: the committed tree being run (recorded in the results); OUTDIR gets log.txt and results.tar.
[[ $1 =~ ^[0-9a-f]{40}$ ]] || { echo "one_gpu.sh: COMMIT must be a full 40-character hash (git rev-parse HEAD), not '$1'"; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SPMD_COMMIT=$1
OUT=${2:-/tmp/one_gpu}; mkdir -p "$OUT"; L=$OUT/log.txt; touch "$OUT/.start"
step() { local t=$1; shift; echo "=== $(date +%T) [$t s] $*" >>"$L"; timeout "$t" "$@" >>"$L" 2>&1; echo "=== rc=$? $(date +%T)" >>"$L"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$L" 2>&1
step 60 torchrun --standalone --nproc-per-node 1 -m launch.train --model tiny --steps 5
# linear_cross_entropy at 8192 x 4096 x 128256 bf16 against eager and torch.compile, peak memory, target met?
step 100 python3 -m benchmarks.kernels --iters 10
# 1B compiled with the Triton kernels (MFU; the compiled run without them: results/2026-11-27-h100-1b-compile)
step 150 python3 -m benchmarks.mfu --model 1b --nproc 1 --no-native --specs fsdp=1 --seq-len 2048 --batch-size 8 \
    --dtype bf16 --compile --kernels triton --no-single --tag compile-triton --rounds 1 --steps 8 --warmup 3 --timeout 140
# spmd's per-block path / plain at a realistic batch, 8 x 2048 (target <= 1.05), eager then compiled
step 170 python3 -m benchmarks.overhead --models 1b --dtypes bf16 --batch 8 --seq 2048 --per-block --compile \
    --steps 10 --warmup 3 --tag per-block-8x2048
step 30 python3 -m benchmarks.overhead_mfu benchmarks/results/*-overhead-per-block-8x2048.json
# float8 linears (torchao, tensorwise) against bf16, 1B compiled, 8 x 2048: tokens/s ratio and step peak memory
# (needs torchao: pip install 'spmd[float8]')
step 150 python3 -m benchmarks.float8 --model 1b --batch 8
# only what this run wrote: a fresh checkout gives every committed result a new mtime too
(cd benchmarks/results && tar cf "$OUT/results.tar" $(find . -type f -newer "$OUT/.start")) 2>>"$L"
