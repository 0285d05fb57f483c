#!/bin/bash
# The one device call of 2026-11-27 (2 x H100), issue 42 point 2: the padded MoE dispatch (no host
# sync) against the exact one, llama-moe-3B --ep 2 --zero 2 at the preset's routing; from the repo root:
#   bash benchmarks/results/2026-11-27-2xh100-a2a/run.sh
# Jobs run one after another, each only if the call's time (BUDGET s) still holds it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}   # two GPUs, also on a larger host
export R=/tmp/a2a
OUT=${OUT:-/tmp/a2aout}
BUDGET=${BUDGET:-435}
HERE=benchmarks/results/2026-11-27-2xh100-a2a
mkdir -p $R $OUT
T0=$(date +%s)
COMMON="--warmup 3 --rounds 7 --steps 4 --profile-steps 2 --memory-phases"
MOE="--model llama-moe-3B --seq-len 2048 --micro-batch 4 --global-batch 8"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
job() {   # tag, seconds it needs at least, timeout s, command...
  local tag=$1 need=$2 to=$3; shift 3
  [[ " $SKIP " == *" $tag "* ]] && return
  local l; l=$(left)
  if (( l < need )); then echo "[$(( $(date +%s) - T0 )) s] skip $tag (${l} s left)" | tee -a $R/times.txt; return; fi
  (( to > l )) && to=$l
  echo "[$(( $(date +%s) - T0 )) s] start $tag (timeout $to s)" | tee -a $R/times.txt
  timeout -k 20 $to "$@" > $R/$tag.log 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - T0 )) s] end $tag rc=$rc" | tee -a $R/times.txt
}
BENCH="python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_train.py"
SKIP=${SKIP:-}   # job tags to leave out (a second call)
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
job check 40 90 env OUT=$R python3 -m torch.distributed.run --standalone --nproc-per-node 2 $HERE/check_padded.py
job compiled 120 200 $BENCH --out $R/compiled --layouts ep2_zero2_compile,ep2_zero2_padded_compile $MOE $COMMON
job eager 80 140 $BENCH --out $R/eager --layouts ep2_zero2,ep2_zero2_padded $MOE $COMMON
job torchtitan 60 120 env OUT=$R/tt python3 benchmarks/suite.py ep2 --only "torchtitan dp2 x ep2" --steps 30
cat $R/compiled/results.jsonl $R/eager/results.jsonl > $R/all.jsonl 2>/dev/null
cp $R/all.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
cp $R/check_padded.json $OUT/ 2>/dev/null
cp $R/tt/suite.jsonl $OUT/torchtitan.jsonl 2>/dev/null
tar czf $OUT/logs.tgz -C $R --exclude='*.txt.gz' $(cd $R && ls *.log 2>/dev/null) 2>/dev/null
python3 $HERE/summary.py $R/all.jsonl $R/check_padded.json $R/tt/suite.jsonl | tee $OUT/summary.txt
grep -i -h -B2 -A8 "Traceback\|error" $R/*.log | tail -40
