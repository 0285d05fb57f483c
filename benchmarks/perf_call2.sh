#!/bin/bash
# notes/perf.md, GPU call 2: the chosen one-GPU bf16 path beside torchtitan 0.2.2 (kit .peer, same call, same GPU)
# (the recorded run, at commit 228afe2, also timed a shared rotary table against the inline rope: no difference; reverted)
set -u
OUT=${OUT:-/tmp/perf}; mkdir -p $OUT
nvidia-smi -L
# torchtitan: Llama 3.2 1B shape untied 16 x 2048, 3B shape 8 x 2048, compiled (its launcher's allocator setting)
STEPS=15 LOG_FREQ=5 T_COMPILE=150 OUT=$OUT bash ../.peer/run.sh llama1b_1gpu_compile llama3b_1gpu_compile 2>&1 | tail -8
# meshtron, with the allocator setting torchtitan runs under (recipes/train.py's default now)
export PYTORCH_ALLOC_CONF=expandable_segments:True
B="python benchmarks/bench_train.py --untie-embeddings --seq-len 2048 --warmup 3 --rounds 3 --steps 4"
run() { local t=$1; shift; timeout -k 10 $t "$@" 2>&1 | grep -v -i warn | grep -E "^\{|Error|error" | cut -c1-300; }
run 120 $B --model llama-1B --micro-batch 16 --layouts 1gpu_compile --out $OUT/m1
run 75 $B --model llama-3B --micro-batch 8 --layouts 1gpu_compile --out $OUT/m3
cat $OUT/m1/results.jsonl $OUT/m3/results.jsonl > $OUT/results.jsonl
python - $OUT <<'PY'
import json, re, sys, os
out = sys.argv[1]
tt = {}
for v, model in (("llama1b_1gpu_compile", "llama-1B"), ("llama3b_1gpu_compile", "llama-3B")):
    p = os.path.join(out, f"tt3_{v}.log")
    lines = [l for l in open(p) if re.search(r"step: *\d+ +loss", l)] if os.path.exists(p) else []
    for l in lines[-2:]:
        print(model, "torchtitan:", re.sub(r"\x1b\[[0-9;]*m", "", l.split(" - ")[-1]).strip())
    if lines:
        l = re.sub(r"\x1b\[[0-9;]*m", "", lines[-1])
        num = lambda k: float(re.search(k + r":\s*([\d,.]+)", l).group(1).replace(",", ""))
        tt[model] = (num("tps"), num("memory"))
print("| meshtron layout | model | step ms | tokens/s | peak GiB alloc / reserved | torchtitan tokens/s | torchtitan peak reserved GiB | meshtron / torchtitan |")
print("|---|---|---|---|---|---|---|---|")
for l in open(os.path.join(out, "results.jsonl")):
    r = json.loads(l)
    if "error" in r:
        print(r["layout"], r["error"][:200]); continue
    t = tt.get(r["model"], (float("nan"), float("nan")))
    print(f"| {r['layout']} | {r['model']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['peak_mem_gib']:.1f} / {r['peak_reserved_gib']:.1f} | {t[0]:,.0f} | {t[1]:.1f} | {r['tokens_per_s_per_gpu'] / t[0]:.3f}x |")
    print("   losses", r["losses"][:3], r["losses"][-2:])
PY
