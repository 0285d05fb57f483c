#!/bin/bash
# cp=4 at 128K against torchtitan cp4_128k, eager and compiled on both sides (4 x H100, carry .peer),
# from the repo root:   bash benchmarks/results/2026-11-28-4xh100-cp/run.sh
# Jobs one after another, each only if the call's time (BUDGET s) still holds it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
R=/tmp/cp128
OUT=${OUT:-/tmp/cp128out}
BUDGET=${BUDGET:-500}
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
st() {   # tag, need, timeout, suite args... (a suite run into $R/tag)
  local tag=$1 need=$2 to=$3; shift 3
  gate $tag $need $to || return
  env OUT=$R/$tag timeout -k 30 $(( TO + 20 )) python3 benchmarks/suite.py "$@" --timeout $TO > $R/$tag.out 2>&1
  echo "[$(( $(date +%s) - T0 )) s] end $tag rc=$?" | tee -a $R/times.txt
  sed "s/^{/{\"tag\": \"$tag\", /" $R/$tag/suite.jsonl >> $R/results.jsonl 2>/dev/null
}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
ROW="128K, cp4 (ring)"
M="--rounds 4 --round-steps 4"
st tt_eager 80 130 cp4 --only "torchtitan cp4 128K" --steps 25
st mt_a2a_compile 100 160 cp4 --only "$ROW" $M --profile-steps 2 --extra="--cp-comm a2a --compile"
export TT3_ARGS="--compile.enable"
st tt_compile 100 160 cp4 --only "torchtitan cp4 128K" --steps 25
unset TT3_ARGS
st mt_a2a 70 120 cp4 --only "$ROW" $M --extra="--cp-comm a2a"
st mt_ring_compile 90 150 cp4 --only "$ROW" $M --extra=--compile
cp $R/results.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.out */*.log */*/profile_*_r0.txt 2>/dev/null))
python3 - $R/results.jsonl <<'PY' | tee $OUT/summary.txt
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    p = r.get("profile") or {}
    print(f"{r['tag']:16s} rc={r.get('rc')} tok/s/GPU={r.get('tokens_per_s_per_gpu')} mfu={r.get('mfu')} "
          f"step_ms={r.get('step_ms')} windows={r.get('tps_windows')} peak={r.get('peak_reserved_gib')} "
          f"profile={ {k: p[k] for k in list(p)[:8]} if isinstance(p, dict) else p}")
PY
grep -h -i -B2 -A6 "Traceback\|OutOfMemory" $R/*/*.log 2>/dev/null | tail -30
