#!/bin/bash
# pp2 x tp2 + SP with the trainer's --cuda-graphs (issue 41, point 3), 4 x H100, llama-1B micro-batch 4,
# from the repo root:   bash benchmarks/results/2026-11-28-4xh100-graphs3/run.sh
# Three jobs in one call, each its own process, one after another, each only if the call's time
# (BUDGET s) still holds it:
#   pp2tp2_compile+graphs:32          the baseline (8 micro-batches of 4, global batch 32)
#   pp2tp2_1f1b_compile+graphs:64     the same at global batch 64 (16 micro-batches of 4)
#   pp2tp2_async_compile+graphs:32    the baseline with --async-tp (inductor's micro-pipeline TP)
# A job is LAYOUT:GLOBAL_BATCH. Derived from ../2026-11-28-4xh100-graphs2/run.sh (the same env,
# command and watchdog: every worker's stacks via SIGABRT, which PYTHONFAULTHANDLER turns into each
# rank's Python stacks in the job's log, 40 s before the job's timeout), without py-spy recording.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True PYTHONFAULTHANDLER=1
ulimit -c 0
R=/tmp/graphs3
OUT=${OUT:-/tmp/graphs3out}
BUDGET=${BUDGET:-450}
CAP=${CAP:-150}              # a job's timeout, s
CAP_ASYNC=${CAP_ASYNC:-180}
JOBS=${JOBS:-"pp2tp2_compile+graphs:32 pp2tp2_1f1b_compile+graphs:64 pp2tp2_async_compile+graphs:32"}
mkdir -p $R $OUT
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt

workers() {   # the ranks' processes: bench_train.py's, not the launcher's (nor timeout's) command line
  for p in $(pgrep -f benchmarks/bench_train.py); do
    tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q torch.distributed.run || echo $p
  done
}

for job in $JOBS; do
  layout=${job%:*}; gb=${job##*:}
  left=$(( BUDGET - $(now) ))
  if (( left < 90 )); then echo "[$(now) s] skip $job ($left s left)" | tee -a $R/times.txt; continue; fi
  cap=$CAP; [[ $layout == *async* ]] && cap=$CAP_ASYNC
  to=$(( left < cap ? left : cap ))
  tag=${layout//+/_}_gb$gb
  echo "[$(now) s] start $job (timeout $to s)" | tee -a $R/times.txt
  env TORCH_LOGS=perf_hints,cudagraphs timeout -k 20 $to python3 -m torch.distributed.run --standalone \
      --nproc-per-node 4 benchmarks/bench_train.py --layouts $layout --model llama-1B --untie-embeddings \
      --seq-len 2048 --micro-batch 4 --global-batch $gb --warmup 3 --steps 4 --rounds 4 --profile-steps 1 \
      --out $R/$tag > $R/$tag.log 2>&1 &
  pid=$!
  ( t=0; while kill -0 $pid 2>/dev/null; do
      if (( t == to - 40 )); then
        echo "[$(now) s] watchdog: SIGABRT to $job's workers $(workers | tr '\n' ' ')" | tee -a $R/times.txt
        for p in $(workers); do kill -ABRT $p 2>/dev/null; done
      fi
      sleep 1; t=$(( t + 1 )); done ) &
  dog=$!
  wait $pid; rc=$?
  wait $dog
  echo "[$(now) s] end $job rc=$rc" | tee -a $R/times.txt
  [[ -f $R/$tag/results.jsonl ]] && python3 -c 'import json, sys
for line in open(sys.argv[1]): print(json.dumps({"job": sys.argv[2], **json.loads(line)}))' $R/$tag/results.jsonl $job \
      >> $R/results.jsonl
done
cp $R/results.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.log */profile_*_r0.txt 2>/dev/null))
{ python3 - $R/results.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(r.get("job", r["layout"]), "ERROR", r["error"][:2000])
        continue
    print(r.get("job", r["layout"]), "step_ms", round(r["step_ms"], 1), [round(x, 1) for x in r["step_ms_rounds"]],
          "tok/s/GPU", round(r["tokens_per_s_per_gpu"]), "mfu", r.get("mfu"), "loss", r.get("losses", [])[-1:],
          "bubble", r.get("bubble_measured"), r.get("bubble_predicted"), "profile", r.get("profile"))
PY
  for f in $R/*.log; do
    echo "== $(basename $f): re-recordings $(grep -c 'Re-recording' $f), skipped cudagraphs $(grep -c -i 'skipping cudagraph' $f)"
    grep -o 'Re-recording function=[^ ]*.*reason=[^.]*' $f | sed 's/mode=[^,]*, //' | sort | uniq -c | sort -rn | head -5
    grep -i 'skipping cudagraph' $f | cut -c1-300 | sort | uniq -c | sort -rn | head -5
  done
  grep -h -i "Traceback\|OutOfMemory\|Error\|Fatal Python error\|symm" $R/*.log 2>/dev/null | cut -c1-300 \
    | sed 's/^\[rank[0-9]*\]:[A-Z][0-9 :.]* [0-9]* //' | sort | uniq -c | sort -rn | head -30
} 2>&1 | tee $OUT/summary.txt
