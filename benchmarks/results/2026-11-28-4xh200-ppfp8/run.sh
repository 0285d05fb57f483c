#!/bin/bash
# Issue 41 on 4 x H100, llama-1B untied, sequence 2048, compiled; from the repo root (carry .peer):
#   bash benchmarks/results/2026-11-28-4xh200-ppfp8/run.sh pp     (call 1)
#   bash benchmarks/results/2026-11-28-4xh200-ppfp8/run.sh fp8    (call 2)
# pp: pp2 x tp2 + SP 1F1B with --cuda-graphs, micro-batch 4, one job at a time, each its own process:
#   pp2tp2_1f1b_compile+graphs:40    10 micro-batches (formula bubble 1/11)
#   pp2tp2_1f1b_compile+graphs:48    12 micro-batches (1/13)
#   pp2tp2_compile+graphs:32         8 micro-batches (1/9), the reference of ../2026-11-28-4xh100-graphs3/
#   A job is LAYOUT:GLOBAL_BATCH; each records bubble_measured (idle of compute kernels) and
#   bubble_pipeline (idle of every kernel but the pipeline's NCCL SendRecv) per rank.
# fp8: the tp4 suite's four FP8 rows (torchtitan 0.2.2 and meshtron, tensorwise), unpacked.
# Each job starts only if the call's time (BUDGET s) still holds it.
set -u
PART=${1:-pp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True PYTHONFAULTHANDLER=1
ulimit -c 0
R=/tmp/ppfp8/$PART
OUT=${OUT:-/tmp/ppfp8out}
BUDGET=${BUDGET:-540}
CAP=${CAP:-150}              # a pp job's timeout, s
JOBS=${JOBS:-"pp2tp2_1f1b_compile+graphs:40 pp2tp2_1f1b_compile+graphs:48 pp2tp2_compile+graphs:32"}
mkdir -p $R $OUT
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt

if [ "$PART" = fp8 ]; then
  # the kit's wheels (torchao for meshtron's --fp8 too) into /tmp/site, stamped as .peer/run.sh stamps them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .peer/whl/*.whl \
    && (cd .peer/whl && ls *.whl | md5sum | cut -c1-12) > /tmp/site/.tt3_stamp
  echo "[$(now) s] start suite" | tee -a $R/times.txt
  PYTHONPATH=/tmp/site OUT=$R/suite python3 benchmarks/suite.py tp4 \
      --only "torchtitan tp4 FP8;tp4 + SP FP8;torchtitan tp2 x fsdp2 FP8;dp2 x tp2 + SP FP8" \
      --steps 30 --rounds 5 --round-steps 4 --profile-steps 1 --timeout 200 --budget $(( BUDGET - $(now) )) \
      > $R/suite.log 2>&1
  echo "[$(now) s] end suite rc=$?" | tee -a $R/times.txt
  cp $R/suite/suite.jsonl $OUT/fp8_suite.jsonl 2>/dev/null
  cp $R/env.txt $OUT/fp8_env.txt; cp $R/times.txt $OUT/fp8_times.txt
  (cd $R && tar czf $OUT/fp8_logs.tgz suite.log suite/*.log $(ls suite/*/profile_*_r0.txt 2>/dev/null))
  { tail -8 $R/suite.log
    grep -h -i "Traceback\|OutOfMemory\|Error" $R/suite/*.log 2>/dev/null | grep -v -i warn | cut -c1-300 \
      | sort | uniq -c | sort -rn | head -20; } 2>&1 | tee $OUT/fp8_summary.txt
  exit 0
fi

for job in $JOBS; do
  layout=${job%:*}; gb=${job##*:}
  left=$(( BUDGET - $(now) ))
  if (( left < 90 )); then echo "[$(now) s] skip $job ($left s left)" | tee -a $R/times.txt; continue; fi
  to=$(( left < CAP ? left : CAP ))
  tag=${layout//+/_}_gb$gb
  echo "[$(now) s] start $job (timeout $to s)" | tee -a $R/times.txt
  timeout -k 20 $to python3 -m torch.distributed.run --standalone \
      --nproc-per-node 4 benchmarks/bench_train.py --layouts $layout --model llama-1B --untie-embeddings \
      --seq-len 2048 --micro-batch 4 --global-batch $gb --warmup 3 --steps 4 --rounds 4 --profile-steps 1 \
      --out $R/$tag > $R/$tag.log 2>&1
  echo "[$(now) s] end $job rc=$?" | tee -a $R/times.txt
  [[ -f $R/$tag/results.jsonl ]] && python3 -c 'import json, sys
for line in open(sys.argv[1]): print(json.dumps({"job": sys.argv[2], **json.loads(line)}))' $R/$tag/results.jsonl $job \
      >> $R/results.jsonl
done
cp $R/results.jsonl $OUT/pp_results.jsonl 2>/dev/null
cp $R/env.txt $OUT/pp_env.txt; cp $R/times.txt $OUT/pp_times.txt
(cd $R && tar czf $OUT/pp_logs.tgz $(ls *.log */profile_*_r[0-3].txt 2>/dev/null))
{ python3 - $R/results.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(r.get("job", r["layout"]), "ERROR", r["error"][:2000])
        continue
    f = r.get("bubble_predicted") or 0
    print(r.get("job"), "step_ms", round(r["step_ms"], 1), [round(x, 1) for x in r["step_ms_rounds"]],
          "tok/s/GPU", round(r["tokens_per_s_per_gpu"]), "mfu", round(r.get("mfu") or 0, 4), "loss", r["losses"][-1:],
          "formula", round(f, 4), "bubble_measured", r.get("bubble_measured"),
          "bubble_pipeline", r.get("bubble_pipeline"),
          "pipeline/formula", [round(b / f, 2) for b in r.get("bubble_pipeline") or []] if f else None,
          "profile", r.get("profile"))
PY
  grep -h -i "Traceback\|OutOfMemory\|Error\|Fatal Python error" $R/*.log 2>/dev/null | cut -c1-300 \
    | sed 's/^\[rank[0-9]*\]:[A-Z][0-9 :.]* [0-9]* //' | sort | uniq -c | sort -rn | head -20
} 2>&1 | tee $OUT/pp_summary.txt
