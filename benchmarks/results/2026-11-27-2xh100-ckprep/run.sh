#!/bin/bash
# --checkpoint-async's host copy made beside the steps (BackgroundSaver.prepare) against the
# commit before it (made by the first save), llama-1B dp2 ZeRO-3, two H100s, from the repo root:
#   bash benchmarks/results/2026-11-27-2xh100-ckprep/run.sh    (the earlier commit's tree in .oldck/)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
R=${OUT:-/tmp/ckprep}; mkdir -p $R
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print(torch.__version__, torch.version.cuda, "nccl", torch.cuda.nccl.version())'; } > $R/env.txt 2>&1
ARGS="--model llama-1B --dp 2 --zero 3 --dtype bf16 --seq-len 2048 --micro-batch 4 --warmup 3 --steps 400 --every 200 --max-saves 2 --modes async"
T0=$(date +%s)
timeout -k 20 280 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_checkpoint.py $ARGS \
    --dir /tmp/ck-new --out $R/new > $R/new.log 2>&1
echo "new rc=$? $(( $(date +%s) - T0 )) s" | tee -a $R/times.txt
(cd .oldck && PYTHONPATH=. timeout -k 20 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/bench_checkpoint.py $ARGS --no-check --dir /tmp/ck-old --out $R/old > $R/old.log 2>&1)
echo "old rc=$? $(( $(date +%s) - T0 )) s" | tee -a $R/times.txt
tail -n 6 $R/new.log $R/old.log
