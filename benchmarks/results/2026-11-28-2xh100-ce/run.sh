#!/bin/bash
# tp2 + SP's overlapped reduce-scatter over copy engines, kind nvidia-h100-x2 (ran on two H200s); from the repo root (carry .peer):
#   bash benchmarks/results/2026-11-28-2xh100-ce/run.sh
# 1. benchmarks/bench_ce_collectives.py: NCCL's against copy-engine reduce-scatter / all-gather at
#    tp2 + SP's sizes, alone and beside bf16 matmuls on another stream.
# 2. the tp2-overlap suite's rows torchtitan tp2, tp2 + SP, --tp-overlap, --tp-overlap copy-engine,
#    unpacked (one job at a time), 28 timed steps a meshtron row (7 rounds of 4).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True PYTHONFAULTHANDLER=1
ulimit -c 0
R=/tmp/ce
OUT=${OUT:-/tmp/ceout}
BUDGET=${BUDGET:-570}
ONLY=${ONLY:-"torchtitan tp2;tp2 + SP;tp2 + SP --tp-overlap;tp2 + SP --tp-overlap copy-engine"}
mkdir -p $R $OUT
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .peer/whl/*.whl \
  && (cd .peer/whl && ls *.whl | md5sum | cut -c1-12) > /tmp/site/.tt3_stamp
echo "[$(now) s] start microbench" | tee -a $R/times.txt
timeout -k 10 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/bench_ce_collectives.py --out $OUT > $R/micro.log 2>&1
echo "[$(now) s] end microbench rc=$?" | tee -a $R/times.txt
cp $R/micro.log $OUT/
echo "[$(now) s] start suite" | tee -a $R/times.txt
PYTHONPATH=/tmp/site OUT=$R/suite python3 benchmarks/suite.py tp2-overlap --only "$ONLY" \
    --steps 30 --rounds 7 --round-steps 4 --profile-steps 2 --timeout 180 --budget $(( BUDGET - $(now) )) \
    > $R/suite.log 2>&1
echo "[$(now) s] end suite rc=$?" | tee -a $R/times.txt
cp $R/suite/suite.jsonl $OUT/suite.jsonl 2>/dev/null
cp $R/env.txt $R/times.txt $R/suite.log $OUT/
(cd $R && tar czf $OUT/logs.tgz suite/*.log $(ls suite/*/profile_*_r[01].txt 2>/dev/null))
sed -n '/^| collective/,$p' $R/micro.log | head -12
tail -8 $R/suite.log
grep -h -i "Traceback\|OutOfMemory\|Error" $R/suite/*.log $R/micro.log 2>/dev/null | grep -v -i warn | cut -c1-300 \
  | sort | uniq -c | sort -rn | head -12
python3 - $R/suite/suite.jsonl <<'PY'
import json, sys
try:
    for line in open(sys.argv[1]):
        r = json.loads(line)
        print(r.get("row") or r.get("name"), "losses", (r.get("losses") or [])[-3:], "step_ms", r.get("step_ms"))
except Exception as e:
    print("no suite.jsonl:", e)
PY
