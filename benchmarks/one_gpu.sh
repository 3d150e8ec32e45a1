#!/bin/bash
# The one-GPU checks, each bounded in time, in the order of their value, every log kept:
#   bash benchmarks/one_gpu.sh COMMIT OUTDIR
# COMMIT: the committed tree being run (recorded in the results); OUTDIR gets log.txt and results.tar.
[[ $1 =~ ^[0-9a-f]{40}$ ]] || { echo "one_gpu.sh: COMMIT must be a full 40-character hash (git rev-parse HEAD), not '$1'"; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SPMD_COMMIT=$1
OUT=${2:-/tmp/one_gpu}; mkdir -p "$OUT"; L=$OUT/log.txt
step() { local t=$1; shift; echo "=== $(date +%T) [$t s] $*" >>"$L"; timeout "$t" "$@" >>"$L" 2>&1; echo "=== rc=$? $(date +%T)" >>"$L"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$L" 2>&1
step 60 torchrun --standalone --nproc-per-node 1 -m launch.train --model tiny --steps 5
step 120 python3 -m pytest -q -n 0 -s -p no:cacheprovider tests/test_offload_cuda.py
step 260 python3 -m benchmarks.overhead --models small 1b --dtypes bf16 --compile --native --steps 20 --warmup 3
step 70 python3 -m benchmarks.kernels --iters 10
step 250 python3 -m benchmarks.mfu --model 1b --nproc 1 --no-native --specs fsdp=1 --seq-len 2048 --batch-size 8 \
    --dtype bf16 --compile --tag compile --rounds 2 --steps 8 --warmup 3 --timeout 200
(cd benchmarks/results && tar cf "$OUT/results.tar" $(ls -t | head -12)) 2>>"$L"
