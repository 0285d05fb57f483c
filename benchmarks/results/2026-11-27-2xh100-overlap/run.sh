#!/bin/bash
# The device call of 2026-11-27 (2 x H100), issue 42 point 3: the overlapped MoE dispatch
# (--moe-dispatch overlap) and FSDP's forward prefetch against the exact dispatch, llama-moe-3B
# --ep 2 --zero 2 compiled at the preset's routing, beside torchtitan moe_ep2_2gpu (eager); from the repo root:
#   bash benchmarks/results/2026-11-27-2xh100-overlap/run.sh
# Jobs run one after another, each only if the call's time (BUDGET s) still holds it; the layouts
# of one job share a process (exact first, but in `reversed`). The second call (the experts' FSDP unit
# called once for both chunks): SKIP="fwdprefetch1 prefetch2" BUDGET=470.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
export R=/tmp/ov
OUT=${OUT:-/tmp/ovout}
BUDGET=${BUDGET:-500}
HERE=benchmarks/results/2026-11-27-2xh100-overlap
mkdir -p $R $OUT
T0=$(date +%s)
COMMON="--warmup 3 --rounds 7 --steps 4 --profile-steps 2"
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
SKIP=${SKIP:-}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'; } > $R/env.txt 2>&1
cat $R/env.txt
job torchtitan 60 130 env OUT=$R/tt python3 benchmarks/suite.py ep2 --only "torchtitan dp2 x ep2" --steps 30
job overlap 120 190 $BENCH --out $R/overlap --layouts ep2_zero2_compile,ep2_zero2_overlap_compile $MOE $COMMON
job fwdprefetch1 120 190 $BENCH --out $R/fwdprefetch1 --layouts ep2_zero2_compile,ep2_zero2_overlap_compile \
    --experiment fsdp-forward-prefetch-1 $MOE $COMMON
job prefetch2 120 190 $BENCH --out $R/prefetch2 --layouts ep2_zero2_pf2_compile,ep2_zero2_overlap_pf2_compile $MOE $COMMON
# the same pair, overlap first in its process
job reversed 120 190 $BENCH --out $R/reversed --layouts ep2_zero2_overlap_compile,ep2_zero2_compile $MOE $COMMON
cat $R/overlap/results.jsonl $R/fwdprefetch1/results.jsonl $R/prefetch2/results.jsonl $R/reversed/results.jsonl \
    > $R/all.jsonl 2>/dev/null
cp $R/all.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
cp $R/tt/suite.jsonl $OUT/torchtitan.jsonl 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.log */profile_*r0.txt tt/*.log 2>/dev/null))
python3 $HERE/summary.py $R/all.jsonl $R/tt/suite.jsonl | tee $OUT/summary.txt
grep -i -h -B2 -A8 "Traceback" $R/*.log | tail -40
