#!/bin/bash
# llama-moe-3B on one GPU: the load balance of the recipe's defaults over 50 steps, then meshtron
# against torchtitan 0.2.2's `run.sh moe_1gpu` (Qwen3-style, 12 x 2048, 16 experts top-2, 4 x 2048
# tokens, bf16, not compiled), each with its natural routing (meshtron's: the recipe's batch
# balancing, and also without it: the router's own choice) and with forced balanced
# (round-robin) routing, in one call. Run from the repository root with the kit in .peer/
# (benchmarks/vs_torchtitan.sh says how to build it):  OUT=$OUT bash benchmarks/moe_vs_torchtitan.sh
# Env: STEPS=50 (the recipe's run)  TT_STEPS=15 (torchtitan's; its tokens/s are its last 5 steps)
#      KIT=the torchtitan kit (default .peer under the root)  TT_T=90 (timeout s per torchtitan run)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/moe_vs_tt}
KIT=${KIT:-$ROOT/.peer}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH=$ROOT OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
command -v nvidia-smi >/dev/null && nvidia-smi -L
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
A="--model llama-moe-3B --seq-len 2048 --micro-batch 4 --dtype bf16"

echo "== the recipe at its defaults, ${STEPS:-50} steps: load max/mean (the worst layer)"
timeout 120 python recipes/train.py $A --steps "${STEPS:-50}" --log-interval 5 > "$OUT/recipe_defaults.log" 2>&1
echo "rc=$?"
grep -E "^step|rror" "$OUT/recipe_defaults.log" | sed -E 's/ \| (lr|grad norm|peak mem|eta) [^|]*//g'

for mode in natural own balanced; do   # own: the router's own choice, batch balancing off
  flag=""; [ $mode = balanced ] && flag="--moe-balanced-routing"; [ $mode = own ] && flag="--moe-batch-balance 0"
  echo "== meshtron bench_train, $mode routing"
  timeout 90 python benchmarks/bench_train.py --layouts 1gpu $A $flag --warmup 2 --steps 3 --rounds 3 \
    --out "$OUT/mt_$mode" > "$OUT/mt_$mode.log" 2>&1
  echo "rc=$?"; grep -E "rror" "$OUT/mt_$mode.log" | tail -3
  python benchmarks/bench_train.py --summarize "$OUT/mt_$mode/results.jsonl"
done

export PYTHONPATH=$ROOT/benchmarks/torchtitan   # tt3_moe_load: torchtitan's routing load
for mode in natural balanced; do
  extra="--experimental.custom_import tt3_moe_load"
  [ $mode = balanced ] && extra="$extra --debug.moe_force_load_balance"
  echo "== torchtitan moe_1gpu, $mode routing"
  OUT=$OUT T=${TT_T:-90} STEPS=${TT_STEPS:-15} TT3_ARGS="$extra" bash "$KIT/run.sh" moe_1gpu 2>&1 | grep -E "rc=|step:|rror" | tail -4
  cp /tmp/tt3_logs/moe_1gpu.log "$OUT/tt_$mode.log" 2>/dev/null
  grep -o "tt3_moe_load: .*" "$OUT/tt_$mode.log" | cut -c1-400
done

python - "$OUT" <<'EOF'
import json, re, sys
out = sys.argv[1]
for mode in ("natural", "own", "balanced"):
    peer = "balanced" if mode == "balanced" else "natural"
    try:
        mt = json.loads(open(f"{out}/mt_{mode}/results.jsonl").readline())
        tt = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", open(f"{out}/tt_{peer}.log").read())]
        load_tt = re.findall(r"tt3_moe_load: .*?: (.*)", open(f"{out}/tt_{peer}.log").read())
        tt_last = load_tt[0].split()[-5:] if load_tt else "n/a"
        print(f"{mode}: meshtron {mt['tokens_per_s_per_gpu']:,.0f} tok/s (load max/mean of the timed steps, "
              f"worst {mt.get('expert_load_timed_max')}) | torchtitan {tt[-1]:,.0f} tok/s (last 5 steps' load "
              f"{tt_last}) | meshtron / torchtitan {mt['tokens_per_s_per_gpu'] / tt[-1]:.3f}x")
    except Exception as e:  # noqa: BLE001 - print what is there
        print(f"{mode}: no ratio ({type(e).__name__}: {e})")
EOF
