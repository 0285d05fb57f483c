#!/bin/bash
# notes/perf.md, GPU call 1: profile and A/B of the one-GPU bf16 paths (llama-1B 16 x 2048, llama-3B 8 x 2048)
set -u
OUT=${OUT:-/tmp/perf}; mkdir -p $OUT
nvidia-smi -L; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
B="python benchmarks/bench_train.py --untie-embeddings --seq-len 2048 --warmup 3 --rounds 3 --steps 4"
run() { local t=$1; shift; timeout -k 10 $t "$@" 2>&1 | grep -v -i warn | grep -E "^\{|Error|error" | cut -c1-400; }
run 140 $B --model llama-1B --micro-batch 16 --layouts 1gpu_fsdp_compile,1gpu_compile --profile-steps 2 --out $OUT/p1
run 100 $B --model llama-1B --micro-batch 16 --layouts 1gpu_compile+flash,1gpu_compile+cudnn,1gpu_compile+whole --out $OUT/p2
run 100 $B --model llama-3B --micro-batch 8 --layouts 1gpu_fsdp_compile,1gpu_compile,1gpu_compile+expandable --out $OUT/p3
cat $OUT/p*/results.jsonl > $OUT/results.jsonl
python benchmarks/bench_train.py --summarize $OUT/results.jsonl --baseline 1gpu_fsdp_compile
python - $OUT/results.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "profile" in r:
        print(r["layout"], {k: round(v, 1) for k, v in r["profile"].items()})
    if "losses" in r:
        print(r["layout"], r["model"], "losses", r["losses"][:3], r["losses"][-2:], "build_s", round(r["build_s"]), "warmup_s", round(r["warmup_s"]))
PY
