#!/bin/bash
# Inductor's CUDA graphs for the compiled blocks (bench_train's +graphs) against the same layouts
# without, at micro-batch 4 where pp2 x tp2 and dp2 x tp2 are host-bound (4 x H100), from the repo root:
#   bash benchmarks/results/2026-11-28-4xh100-graphs/run.sh
# Each job its own process, one after another, each only if the call's time (BUDGET s) still holds it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
R=/tmp/graphs
OUT=${OUT:-/tmp/graphsout}
BUDGET=${BUDGET:-500}
JOBS=${JOBS:-"pp2tp2_compile+graphs pp2tp2_compile tp2dp2_compile+graphs tp2dp2_compile"}
mkdir -p $R $OUT
T0=$(date +%s)
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
for layout in $JOBS; do
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if (( left < 90 )); then echo "[$(( $(date +%s) - T0 )) s] skip $layout ($left s left)" | tee -a $R/times.txt; continue; fi
  to=$(( left < 170 ? left : 170 ))
  tag=${layout//+/_}
  echo "[$(( $(date +%s) - T0 )) s] start $layout (timeout $to s)" | tee -a $R/times.txt
  env TORCH_LOGS=perf_hints timeout -k 20 $to python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
      benchmarks/bench_train.py --layouts $layout --model llama-1B --untie-embeddings --seq-len 2048 \
      --micro-batch 4 --global-batch 32 --warmup 3 --steps 4 --rounds 4 --profile-steps 1 --out $R/$tag \
      > $R/$tag.log 2>&1
  echo "[$(( $(date +%s) - T0 )) s] end $layout rc=$?" | tee -a $R/times.txt
  cat $R/$tag/results.jsonl >> $R/results.jsonl 2>/dev/null
done
cp $R/results.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.log */profile_*_r0.txt 2>/dev/null))
python3 - $R/results.jsonl <<'PY' | tee $OUT/summary.txt
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["layout"], "step_ms", round(r["step_ms"], 1), [round(x, 1) for x in r["step_ms_rounds"]],
          "tok/s/GPU", round(r["tokens_per_s_per_gpu"]), "mfu", r.get("mfu"), "loss", r.get("losses", [])[-1:],
          "bubble", r.get("bubble_measured"), "profile", r.get("profile"))
PY
grep -h -i "cudagraph\|Traceback\|OutOfMemory\|Error" $R/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -30
