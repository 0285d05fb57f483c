#!/bin/bash
# Two H200s, 2026-11-28 (issue 42): llama-moe-3B --ep 2 beside torchtitan moe_ep2_2gpu in one call,
# meshtron's rows profiled with their timelines. From the repo root:
#   bash benchmarks/results/2026-11-28-2xh200-moe/run.sh LAYOUTS[@EXPERIMENT] ...
# each argument one bench_train process (LAYOUTS a comma list of its layouts, EXPERIMENT its --experiment).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
R=/tmp/moe; OUT=${OUT:-/tmp/moeout}; BUDGET=${BUDGET:-540}; SKIP=${SKIP:-}
mkdir -p $R $OUT
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
job() {   # tag, seconds it needs at least, timeout s, command...
  local tag=$1 need=$2 to=$3; shift 3
  [[ " $SKIP " == *" $tag "* ]] && return
  local l; l=$(left)
  if (( l < need )); then echo "[$(( $(date +%s) - T0 )) s] skip $tag (${l} s left)" | tee -a $R/times.txt; return; fi
  (( to > l )) && to=$l
  echo "[$(( $(date +%s) - T0 )) s] start $tag (timeout $to s)" | tee -a $R/times.txt
  timeout -k 20 $to "$@" > $R/$tag.log 2>&1
  echo "[$(( $(date +%s) - T0 )) s] end $tag rc=$?" | tee -a $R/times.txt
}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
MOE="--model llama-moe-3B --seq-len 2048 --micro-batch 4 --global-batch 8"
job torchtitan 60 120 env OUT=$R/tt python3 benchmarks/suite.py ep2 --only "torchtitan dp2 x ep2" --steps 30
i=0
for spec in "$@"; do   # LAYOUTS[@EXPERIMENT]: one process each, in the order given
  i=$((i + 1)); layouts=${spec%%@*}; exp=""; [[ $spec == *@* ]] && exp=${spec#*@}
  job m$i 100 ${MESHTRON_TIMEOUT:-200} python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/bench_train.py --out $R/m$i --layouts $layouts --experiment "$exp" $MOE --warmup 3 --rounds 7 --steps 4 \
    --profile-steps 2 --trace
  cat $R/m$i/results.jsonl >> $OUT/meshtron.jsonl 2>/dev/null
done
cp $R/tt/suite.jsonl $OUT/torchtitan.jsonl; cat $R/env.txt $R/times.txt > $OUT/env.txt
(cd $R && tar czf $OUT/profiles.tgz $(ls -d m*/profile_*.txt *.log tt/*.log 2>/dev/null))
(cd $R && tar czf $OUT/traces.tgz $(ls -d m*/trace_*.json.gz 2>/dev/null))
{ python3 benchmarks/bench_train.py --summarize $OUT/meshtron.jsonl; cat $R/tt/suite.jsonl; } | tee $OUT/summary.txt
grep -h -B2 -A12 "Traceback" $R/*.log | tail -40
