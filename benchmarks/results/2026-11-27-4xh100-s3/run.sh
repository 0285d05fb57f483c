#!/bin/bash
# The one device call of 2026-11-27 (4 x H100): issue 43 (A: pp2 x tp2 memory, B: dp2 x tp2 ZeRO-3) and
# issue 42 point 1 (C: ep2 ZeRO-2 compiled, router's own / forced balanced / defaults), from the repo root:
#   bash benchmarks/results/2026-11-27-4xh100-s3/run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
export R=/tmp/s3
OUT=${OUT:-/tmp/s3out}
HERE=benchmarks/results/2026-11-27-4xh100-s3
mkdir -p $R $OUT
T0=$(date +%s)
COMMON="--warmup 3 --rounds 7 --steps 4 --profile-steps 2 --memory-phases"
L1B="--model llama-1B --untie-embeddings --seq-len 2048"
MOE="--model llama-moe-3B --seq-len 2048 --micro-batch 4 --global-batch 8"
job() {   # tag, GPUs, CUDA_VISIBLE_DEVICES, timeout s, bench_train args...
  local tag=$1 n=$2 dev=$3 to=$4; shift 4
  echo "[$(( $(date +%s) - T0 )) s] start $tag on GPUs $dev" | tee -a $R/times.txt
  ( CUDA_VISIBLE_DEVICES=$dev timeout -k 20 $to python3 -m torch.distributed.run --standalone --nproc-per-node $n \
      benchmarks/bench_train.py --out $R/$tag $COMMON "$@" > $R/$tag.log 2>&1
    echo "[$(( $(date +%s) - T0 )) s] end $tag rc=$?" | tee -a $R/times.txt )
}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
# A: issue 43, the pp row (pp2 x tp2 + SP, micro-batch 4, 8 micro-batches, 1F1B)
job A_pp2tp2 4 0,1,2,3 150 --layouts pp2tp2_compile $L1B --micro-batch 4 --global-batch 32 --pp-schedule 1f1b
# C: issue 42 point 1, side by side: the router's own routing | forced balanced
job C_own 2 0,1 130 --layouts ep2_zero2_compile $MOE --moe-batch-balance 0 &
job C_balanced 2 2,3 130 --layouts ep2_zero2_compile $MOE --moe-balanced-routing &
wait
# B: issue 43, dp2 x tp2 + SP ZeRO-3, micro-batch 16
job B_dp2tp2_zero3 4 0,1,2,3 150 --layouts tp2dp2_zero3_compile $L1B --micro-batch 16 --global-batch 32
# C with the preset's defaults (batch balancing, the suite's row) | the all-to-all floor
job C_default 2 0,1 120 --layouts ep2_zero2_compile $MOE &
( CUDA_VISIBLE_DEVICES=2,3 timeout -k 10 60 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    $HERE/a2a_floor.py > $R/a2a_floor.log 2>&1; echo "a2a_floor rc=$?" >> $R/times.txt ) &
wait
cat $R/*/results.jsonl > $R/all.jsonl 2>/dev/null
cp $R/all.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
cp $R/a2a_floor.jsonl $OUT/ 2>/dev/null
tar czf $OUT/s3.tgz -C /tmp s3
python3 $HERE/summary.py $R/all.jsonl $R/a2a_floor.jsonl | tee $OUT/summary.txt
tail -n 5 $R/*.log | grep -i -B2 "error\|Traceback" | tail -40
