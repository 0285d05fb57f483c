#!/bin/bash
# Inductor's CUDA graphs of the compiled blocks with FSDP's gathered weights kept in place between
# steps (bench_train's +graphs+keepweights) against the same layouts without, at micro-batch 4 where
# pp2 x tp2 and dp2 x tp2 are host-bound (4 x H100), from the repo root:
#   bash benchmarks/results/2026-11-28-4xh100-graphs2/run.sh
# Derived from ../2026-11-28-4xh100-graphs/run.sh, with hang diagnostics: a watchdog dumps every
# worker's stacks (py-spy where it is on the PATH, twice 3 s apart, then SIGABRT, which
# PYTHONFAULTHANDLER turns into each rank's Python stacks in the job's log) 40 s before the job's
# timeout. +graphs jobs log with TORCH_LOGS=perf_hints,cudagraphs (each re-recording and its reason).
# A job named LAYOUT@spy runs LAYOUT with py-spy recording ranks 0 and 2 (a host-time profile with no
# torch profiler, 250 samples/s, non-blocking; speedscope files in logs.tgz).
# Each job its own process, one after another, each only if the call's time (BUDGET s) still holds it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True PYTHONFAULTHANDLER=1
ulimit -c 0
R=/tmp/graphs2
OUT=${OUT:-/tmp/graphs2out}
BUDGET=${BUDGET:-560}
CAP_GRAPHS=${CAP_GRAPHS:-220}   # a +graphs job's timeout, s (the plain ones: CAP)
CAP=${CAP:-130}
JOBS=${JOBS:-"pp2tp2_compile+graphs+keepweights pp2tp2_compile tp2dp2_compile+graphs+keepweights tp2dp2_compile"}
mkdir -p $R $OUT
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  echo "py-spy: $(command -v py-spy || echo none)"
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt

workers() {   # the ranks' processes: bench_train.py's, not the launcher's (nor timeout's) command line
  for p in $(pgrep -f benchmarks/bench_train.py); do
    tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q torch.distributed.run || echo $p
  done
}

dump_stacks() {   # $1: the job's tag; py-spy's stacks into $R/$1.stacks, then each rank's own into its log
  local tag=$1 p
  echo "[$(now) s] watchdog: dumping stacks of $tag (workers: $(workers | tr '\n' ' '))" | tee -a $R/times.txt
  if command -v py-spy >/dev/null; then
    for pass in 1 2; do
      for p in $(workers); do
        { echo "=== pass $pass pid $p $(tr '\0' '\n' < /proc/$p/environ | grep '^RANK=')"
          timeout 8 py-spy dump --native --pid $p 2>&1 || timeout 5 py-spy dump --pid $p 2>&1; } > $R/$tag.stacks.$p.$pass &
      done
      wait
      sleep 3
    done
    cat $R/$tag.stacks.* > $R/$tag.stacks 2>/dev/null; rm -f $R/$tag.stacks.*
  fi
  for p in $(workers); do kill -ABRT $p 2>/dev/null; done
}

spy_record() {   # $1: the job's tag; py-spy on ranks 0 and 2 until they exit
  local tag=$1 p r
  for _ in $(seq 60); do (( $(workers | wc -l) >= 4 )) && break; sleep 1; done
  for p in $(workers); do
    r=$(tr '\0' '\n' < /proc/$p/environ | grep '^RANK=' | cut -d= -f2)
    if [[ $r == 0 || $r == 2 ]]; then
      py-spy record --pid $p --rate 250 --nonblocking --idle --format speedscope -o $R/$tag.spy.r$r.json \
          > $R/$tag.spy.r$r.log 2>&1 &
    fi
  done
  wait
}

for job in $JOBS; do
  layout=${job%@spy}
  left=$(( BUDGET - $(now) ))
  if (( left < 90 )); then echo "[$(now) s] skip $job ($left s left)" | tee -a $R/times.txt; continue; fi
  cap=$CAP; logs=perf_hints
  if [[ $layout == *+graphs* ]]; then cap=$CAP_GRAPHS; logs=perf_hints,cudagraphs; fi
  to=$(( left < cap ? left : cap ))
  tag=${job//+/_}; tag=${tag//@/_}
  echo "[$(now) s] start $job (timeout $to s)" | tee -a $R/times.txt
  env TORCH_LOGS=$logs timeout -k 20 $to python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
      benchmarks/bench_train.py --layouts $layout --model llama-1B --untie-embeddings --seq-len 2048 \
      --micro-batch 4 --global-batch 32 --warmup 3 --steps 4 --rounds 4 --profile-steps 1 --out $R/$tag \
      > $R/$tag.log 2>&1 &
  pid=$!
  spy=
  if [[ $job == *@spy ]] && command -v py-spy >/dev/null; then spy_record $tag & spy=$!; fi
  ( t=0; while kill -0 $pid 2>/dev/null; do
      if (( t == to - 40 )); then dump_stacks $tag; fi
      sleep 1; t=$(( t + 1 )); done ) &
  dog=$!
  wait $pid; rc=$?
  wait $dog $spy
  echo "[$(now) s] end $job rc=$rc" | tee -a $R/times.txt
  [[ -f $R/$tag/results.jsonl ]] && python3 -c 'import json, sys
for line in open(sys.argv[1]): print(json.dumps({"job": sys.argv[2], **json.loads(line)}))' $R/$tag/results.jsonl $job \
      >> $R/results.jsonl
done
cp $R/results.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.log *.stacks *.spy.*.json */profile_*_r0.txt 2>/dev/null))
{ python3 - $R/results.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r.get("job", r["layout"]), "step_ms", round(r["step_ms"], 1), [round(x, 1) for x in r["step_ms_rounds"]],
          "tok/s/GPU", round(r["tokens_per_s_per_gpu"]), "mfu", r.get("mfu"), "loss", r.get("losses", [])[-1:],
          "bubble", r.get("bubble_measured"), r.get("bubble_predicted"), "profile", r.get("profile"))
PY
  for f in $(ls $R/*.log | grep -v "\.spy\."); do
    echo "== $(basename $f): re-recordings $(grep -c 'Re-recording' $f), skipped cudagraphs $(grep -c -i 'skipping cudagraph' $f)"
    grep -o 'Re-recording function=[^ ]*.*reason=[^.]*' $f | sed 's/mode=[^,]*, //' | sort | uniq -c | sort -rn | head -5
    grep -o 'input name: [^ ]* [a-z ]*changed' $f | sort | uniq -c | sort -rn | head -8
  done
  grep -h -i "cudagraph\|Traceback\|OutOfMemory\|Error\|Fatal Python error" $R/*.log 2>/dev/null | cut -c1-300 \
    | sed 's/^\[rank[0-9]*\]:[A-Z][0-9 :.]* [0-9]* //' | sort | uniq -c | sort -rn | head -40
} 2>&1 | tee $OUT/summary.txt
