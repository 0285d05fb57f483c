#!/usr/bin/env bash
# The FP8 measurement of notes/fp8.md, one GPU: bf16 vs FP8 tensorwise vs rowwise, llama-1B untied,
# compiled, 16 x 2048, in one process (then tensorwise with fp8 weight gathers at dp 1 in a second one).
# Run from the checkout root with torchao installed; $OUT receives results.jsonl.
cd "$(dirname "$0")/.."
python -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())" || exit 1
# 16 x 2048 in bf16 needs an H200's memory; an H100 (80 GB) takes 8 sequences
MB=$(python -c "import torch; print(16 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 8)")
A="--model llama-1B --untie-embeddings --micro-batch $MB --seq-len 2048 --out $OUT"
timeout 270 env PYTHONPATH=. python benchmarks/bench_train.py \
  --layouts 1gpu_compile,1gpu_fp8_compile,1gpu_fp8_rowwise_compile $A 2>&1 | grep -v Warning | tail -4
timeout 80 env PYTHONPATH=. python benchmarks/bench_train.py --layouts 1gpu_fp8_compile --experiment fp8-fp8-gather \
  $A 2>&1 | tail -1
python benchmarks/bench_train.py --summarize "$OUT/results.jsonl"
python - "$OUT/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = next((r for r in rows if r["layout"] == "1gpu_compile" and "error" not in r), None)
for r in rows:
    if "error" in r:
        print(r["layout"], "ERROR", r["error"][:300]); continue
    ratio = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
    print(f"{r['layout']:28s} {r['experiment'] or '-':16s} {r['tokens_per_s_per_gpu']:9,.0f} tok/s  "
          f"x{ratio:.3f} vs bf16  peak {r['peak_mem_gib']:.1f} GiB alloc / {r['peak_reserved_gib']:.1f} reserved  "
          f"losses {r['losses'][:2]}..{r['losses'][-1]}  step_ms {['%.0f' % x for x in r['step_ms_rounds']]}")
PY
