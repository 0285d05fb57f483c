#!/bin/bash
# Call 2 of 2026-11-27 (4 x H100, carry .peer): issue 41 point 4, llama-8B dp4 at a larger batch, from the repo root:
#   bash benchmarks/results/2026-11-27-4xh100-rows/call2.sh
# torchtitan llama8b_fsdp4_compile at local batch 4 (the kit directly: the `fsdp4` suite's peer row fixes batch 2),
# meshtron's `fsdp4` suite rows "llama-8B dp4 ZeRO-3" at micro-batch 4 (global batch 16, one micro-batch a step;
# --extra overrides the row's batch) and at the row's own micro-batch 2, then ZeRO-2 at micro-batch 4.
# Jobs run one after another, each only if the call's time (BUDGET s) still holds it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
HERE=benchmarks/results/2026-11-27-4xh100-rows
R=/tmp/rows2
OUT=${OUT:-/tmp/rows2out}
BUDGET=${BUDGET:-505}
SKIP=${SKIP:-}
mkdir -p $R $OUT
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
TO=0
gate() {   # tag, seconds it needs at least, timeout s: sets TO, or fails (skip)
  local tag=$1 need=$2 to=$3 l
  [[ " $SKIP " == *" $tag "* ]] && return 1
  l=$(left)
  if (( l < need )); then echo "[$(( $(date +%s) - T0 )) s] skip $tag (${l} s left)" | tee -a $R/times.txt; return 1; fi
  (( to > l )) && to=$l
  TO=$to
  echo "[$(( $(date +%s) - T0 )) s] start $tag (timeout $TO s)" | tee -a $R/times.txt
}
done_() { echo "[$(( $(date +%s) - T0 )) s] end $1 rc=$2" | tee -a $R/times.txt; }
steps_of() {   # tag, torchtitan variant: its logged steps from the kit's full log
  grep -E "step: *[0-9]+ +loss" /tmp/tt3_logs/$2.log | sed 's/^.*root - INFO - //' > $R/$1.steps
}
st() {   # tag, need, timeout, suite args... (a suite run into $R/tag)
  local tag=$1 need=$2 to=$3; shift 3
  gate $tag $need $to || return
  env OUT=$R/$tag timeout -k 30 $(( TO + 20 )) python3 benchmarks/suite.py "$@" --timeout $TO > $R/$tag.out 2>&1
  done_ $tag $?
}
tt() {   # tag, need, timeout, row name, variant, steps (the kit directly, for variants no suite row names)
  local tag=$1 need=$2 to=$3 name=$4 v=$5 n=$6
  gate $tag $need $to || return
  STEPS=$n LOG_FREQ=5 T=$TO T_COMPILE=$TO bash .peer/run.sh $v > $R/$tag.out 2>&1
  done_ $tag $?
  steps_of $tag $v
  python3 $HERE/rows.py peer $R/$tag "$name" $v 4 $R/$tag.steps
}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
B4="--micro-batch 4 --global-batch 16"
M="--rounds 4 --round-steps 4"
TT3_ARGS="--training.local_batch_size 4" tt tt_8b_lb4 80 130 "torchtitan llama-8B fsdp4" llama8b_fsdp4_compile 30
st mt_zero3_mb4 110 170 fsdp4 --only "llama-8B dp4 ZeRO-3" $M --profile-steps 1 --extra="$B4"
st mt_zero3_mb2 100 150 fsdp4 --only "llama-8B dp4 ZeRO-3" $M --profile-steps 0
st mt_zero2_mb4 105 160 fsdp4 --only "llama-8B dp4 ZeRO-2" $M --profile-steps 1 --extra="$B4"
python3 $HERE/rows.py merge $R/results.jsonl $R
for f in $R/tt_*.steps; do echo "== $(basename $f)"; cat $f; done > $OUT/tt_steps.txt 2>/dev/null
cp $R/results.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.out */*.log */*/profile_*_r0.txt 2>/dev/null))
python3 $HERE/rows.py summary $R/results.jsonl | tee $OUT/summary.txt
grep -h -i -B2 -A6 "Traceback\|OutOfMemory" $R/*/*.log 2>/dev/null | tail -30
