#!/bin/bash
# Call 1 of 2026-11-27 (4 x H100, carry .peer): issue 42's four-GPU rows, from the repo root:
#   bash benchmarks/results/2026-11-27-4xh100-rows/call1.sh
# The `ep4` suite's torchtitan moe_ep4 and meshtron --ep 4 --zero 1 rows, the `cp4` suite's 128K rows, then
# meshtron's ep4 compiled (the suite's row with --extra --compile) and torchtitan moe_ep4_compile.
# Jobs run one after another, each only if the call's time (BUDGET s) still holds it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
HERE=benchmarks/results/2026-11-27-4xh100-rows
R=/tmp/rows1
OUT=${OUT:-/tmp/rows1out}
BUDGET=${BUDGET:-495}
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
M="--profile-steps 2 --rounds 5 --round-steps 4"
st tt_ep4 60 120 ep4 --only "torchtitan dp4 x ep4" --steps 40
steps_of tt_ep4 moe_ep4
st mt_ep4 50 120 ep4 --only="--ep 4 --zero 1" $M
st tt_cp4_128k 70 130 cp4 --only "torchtitan cp4 128K" --steps 30
steps_of tt_cp4_128k cp4_128k
st mt_cp4_128k 60 120 cp4 --only "128K, cp4 (ring)" --profile-steps 2 --rounds 4 --round-steps 4
st mt_ep4_compile 70 140 ep4 --only="--ep 4 --zero 1" $M --extra=--compile
tt tt_ep4_compile 75 110 "torchtitan dp4 x ep4, compiled" moe_ep4_compile 30
python3 $HERE/rows.py merge $R/results.jsonl $R
for f in $R/tt_*.steps; do echo "== $(basename $f)"; cat $f; done > $OUT/tt_steps.txt 2>/dev/null
cp $R/results.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.out */*.log */*/profile_*_r0.txt 2>/dev/null))
python3 $HERE/rows.py summary $R/results.jsonl | tee $OUT/summary.txt
grep -h -i -B2 -A6 "Traceback\|OutOfMemory" $R/*/*.log 2>/dev/null | tail -30
