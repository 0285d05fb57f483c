#!/bin/bash
# The trainer's --cuda-graphs (bench_train's +graphs now passes it: CUDA graphs of the compiled blocks,
# FSDP's gathered weights kept in place, a graph generation opened each step; no patch in the
# benchmark) against the plain compiled rows, 4 x H100, llama-1B micro-batch 4, from the repo root:
#   bash benchmarks/results/2026-11-28-4xh100-cuda-graphs-flag/run.sh
# The day's graphs2 script, with its jobs and time limits given (each layout its own process).
JOBS="pp2tp2_compile+graphs pp2tp2_compile tp2dp2_compile+graphs tp2dp2_compile" BUDGET=300 CAP_GRAPHS=150 CAP=110 \
    bash benchmarks/results/2026-11-28-4xh100-graphs2/run.sh
