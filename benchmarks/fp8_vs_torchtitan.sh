#!/bin/bash
# Issue 26's one-GPU table in one call: meshtron's recipe step (bench_train.py) and torchtitan
# 0.2.2 (the kit in .peer), bf16 and FP8 tensorwise, compiled, Llama 3.2 shapes untied, seq 2048,
# at the issue's batches (16 x 2048 for 1B, 8 x 2048 for 3B: an H200's memory); GPT=1 adds the
# GPT 1.3B's FP8 speed-up over bf16 (no peer), micro-batch 8.
#   device call (carry [".peer"]): OUT=$OUT MODELS="1B 3B" GPT=1 bash benchmarks/fp8_vs_torchtitan.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8tt}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps .peer/whl/torchao-0.17.0*.whl 2>&1 | tail -1
nvidia-smi -L
python3 -c "import torch, torchao, triton; print('torch', torch.__version__, 'torchao', torchao.__version__, 'triton', triton.__version__)"
export PYTORCH_ALLOC_CONF=expandable_segments:True   # torchtitan's launcher setting, the recipe's default
B="python3 benchmarks/bench_train.py --seq-len 2048 --warmup 3 --rounds 3 --steps 4 --layouts 1gpu_compile,1gpu_fp8_compile"
quiet() { grep -v -i warn | grep -E "^\{|Error|error" | cut -c1-300; }
for M in ${MODELS:-1B 3B}; do
  case $M in 1B) MB=16; V=llama1b ;; 3B) MB=8; V=llama3b ;; esac
  STEPS=15 LOG_FREQ=5 T_COMPILE=200 OUT=$OUT TT3_ARGS="--training.local_batch_size $MB" \
    bash .peer/run.sh ${V}_1gpu_compile ${V}_1gpu_fp8 2>&1 | tail -4
  timeout -k 10 420 $B --model llama-$M --untie-embeddings --micro-batch $MB --out "$OUT/m$M" 2>&1 | quiet
done
[ "${GPT:-0}" = 1 ] && timeout -k 10 300 $B --model 1.3B --micro-batch 8 --out "$OUT/gpt" 2>&1 | quiet
python3 - "$OUT" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
def tt(variant):   # torchtitan's last logged tokens/s (mean of its last LOG_FREQ steps) and reserved peak
    p = os.path.join(out, f"tt3_{variant}.log")
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in open(p) if re.search(r"step: *\d+ +loss", l)] if os.path.exists(p) else []
    if not lines:
        return float("nan"), float("nan")
    num = lambda k: float(re.search(k + r":\s*([\d,.]+)", lines[-1]).group(1).replace(",", ""))
    return num("tps"), num("memory")
rows = [json.loads(l) for f in sorted(glob.glob(os.path.join(out, "*", "results.jsonl"))) for l in open(f) if l.strip()]
print("| model, batch | precision | meshtron tokens/s (step ms) | meshtron peak GiB alloc / reserved | torchtitan tokens/s | torchtitan reserved GiB | meshtron / torchtitan | FP8 / bf16 (meshtron) |")
print("|---|---|---|---|---|---|---|---|")
bf16 = {r["model"]: r["tokens_per_s_per_gpu"] for r in rows if "error" not in r and r["layout"] == "1gpu_compile"}
for r in rows:
    if "error" in r:
        print(r["model"], r["layout"], "ERROR", r["error"][:300]); continue
    fp8 = "fp8" in r["layout"]
    v = {"llama-1B": "llama1b", "llama-3B": "llama3b"}.get(r["model"])
    t = tt(f"{v}_1gpu_{'fp8' if fp8 else 'compile'}") if v else (float("nan"), float("nan"))
    print(f"| {r['model']}, {r['global_batch']} x 2048 | {'FP8 tensorwise' if fp8 else 'bf16'} | {r['tokens_per_s_per_gpu']:,.0f} ({r['step_ms']:.1f}) "
          f"| {r['peak_mem_gib']:.1f} / {r['peak_reserved_gib']:.1f} | {t[0]:,.0f} | {t[1]:.2f} | {r['tokens_per_s_per_gpu'] / t[0]:.3f}x "
          f"| {r['tokens_per_s_per_gpu'] / bf16.get(r['model'], float('nan')):.3f}x |")
    print("   losses", r["losses"][:2], r["losses"][-2:])
PY
