#!/bin/bash
# Convergence on real text, not only speed: meshtron bf16, meshtron FP8 and torchtitan 0.2.2 bf16 train
# llama-1B (untied, compiled, one GPU) on the same corpus, tokenizer, batch and learning-rate schedule
# (warmup, then cosine to 0.1 of the peak over the whole run: torchtitan's decay_type cosine with
# decay_ratio 1 and min_lr_factor 0.1 is meshtron's warmup_cosine), then one plot of the three curves.
#
# Same tokens: `prepare` (once; the default list runs it where its file is missing; the peer kit's assets
# in ASSETS, default .peer/: benchmarks/peers/torchtitan/README.md)
# replays torchtitan's loader (each document as BOS + ids + EOS, one stream, cut into windows of SEQ + 1
# tokens, re-looped at the end) for STEPS x MB windows and writes each window's first SEQ tokens to a
# .u16 file, which meshtron reads in order (--no-shuffle): every step both see the same inputs, and all
# targets but each sequence's last are the same.
# Run on the GPU machine from the checkout, with the kit's assets and torchao installed (or: python -m benchmarks
# run convergence, whose rows are the summary's means):
#   OUT=$OUT bash benchmarks/convergence.sh [bf16] [fp8] [torchtitan]     (default: all three, then the summary)
#   bash benchmarks/convergence.sh summary        (last-20-step means and the plot from $OUT)
# Env: MT_ARGS (more meshtron flags) STEPS=300 MB=8 (sequences a step) SEQ=2048 LR=3e-4 (llama-1B's preset) WARMUP=30 MODEL=llama-1B
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ASSETS=${ASSETS:-$ROOT/.peer}
OUT=${OUT:-/tmp/convergence}
STEPS=${STEPS:-300} MB=${MB:-8} SEQ=${SEQ:-2048} LR=${LR:-3e-4} WARMUP=${WARMUP:-30} MODEL=${MODEL:-llama-1B}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTORCH_ALLOC_CONF=expandable_segments:True
mkdir -p "$OUT"
if [ $# -eq 0 ]; then
  set -- bf16 fp8 torchtitan summary
  [ -f "$ASSETS/mt/c4_tt.u16" ] || set -- prepare "$@"
fi

meshtron() {  # name, extra flags
  local name=$1; shift
  rm -f "$OUT/$name.jsonl"
  echo "=== meshtron $name"
  PYTHONPATH=$ROOT $PY "$ROOT/recipes/train.py" --model "$MODEL" --untie-embeddings --dtype bf16 --compile \
    --seq-len "$SEQ" --micro-batch "$MB" --steps "$STEPS" --lr "$LR" --warmup "$WARMUP" \
    --data "$ASSETS/mt/c4_tt.u16" --no-shuffle --seed 0 --log-interval 1 --metrics-file "$OUT/$name.jsonl" "$@" ${MT_ARGS:-} 2>&1 | grep -v Warning | tail -4
}

torchtitan() {  # its log's "step: N  loss: X" lines -> the JSON lines meshtron.plot reads
  echo "=== torchtitan bf16"
  STEPS=$STEPS LOG_FREQ=1 T_COMPILE=900 TT3_ARGS="--training.local_batch_size $MB --training.seq_len $SEQ \
    --optimizer.lr $LR --lr_scheduler.warmup_steps $WARMUP --lr_scheduler.decay_type cosine \
    --lr_scheduler.decay_ratio 1.0 --lr_scheduler.min_lr_factor 0.1" \
    ASSETS=$ASSETS bash "$ROOT/benchmarks/peers/torchtitan/run.sh" llama1b_1gpu_compile 2>&1 | tail -3
  sed 's/\x1b\[[0-9;]*m//g' /tmp/tt3_logs/llama1b_1gpu_compile.log \
    | $PY -c "import re,sys,json
for l in sys.stdin:
    m = re.search(r'step:\s*(\d+)\s+loss:\s*([0-9.]+)', l)
    if m: print(json.dumps({'step': int(m[1]), 'loss': float(m[2])}))" > "$OUT/torchtitan.jsonl"
}

prepare() {
  mkdir -p "$ASSETS/mt"
  $PY - "$ASSETS" "$STEPS" "$MB" "$SEQ" <<'PY'
import json, sys
import numpy as np
from tokenizers import Tokenizer
kit, steps, mb, seq = sys.argv[1], *map(int, sys.argv[2:])
tok = Tokenizer.from_file(f"{kit}/tokenizer/tokenizer.json")
bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
docs = [json.loads(l)["text"] for l in open(f"{kit}/data/c4_test/data.json") if l.strip()]
windows, buf = [], []
while len(windows) < steps * mb:
    for text in docs:
        buf += [bos] + tok.encode(text).ids + [eos]
        while len(buf) >= seq + 1 and len(windows) < steps * mb:
            windows.append(buf[:seq])
            buf = buf[seq + 1:]
out = np.asarray([t for w in windows for t in w] + [eos], dtype=np.uint16)
out.tofile(f"{kit}/mt/c4_tt.u16")
print(f"{len(windows)} windows of {seq} tokens ({len(docs)} documents) -> {kit}/mt/c4_tt.u16")
PY
}

summary() {
  $PY - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
means = {}
for name in ("bf16", "fp8", "torchtitan"):
    path = os.path.join(out, name + ".jsonl")
    if not os.path.exists(path):
        continue
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]
    last = sorted({r["step"]: r["loss"] for r in rows}.items())[-20:]
    means[name] = sum(v for _, v in last) / len(last)
    print(f"{name:11s} steps {last[0][0]}-{last[-1][0]}: mean loss {means[name]:.4f}")
if "fp8" in means and "bf16" in means:
    print(f"fp8 vs bf16: {100 * (means['fp8'] / means['bf16'] - 1):+.2f}% (target within 1.5%)")
if "torchtitan" in means and "bf16" in means:
    print(f"meshtron bf16 vs torchtitan bf16: {100 * (means['bf16'] / means['torchtitan'] - 1):+.2f}% (target within 2%)")
PY
  local files=() labels=()
  for n in bf16 fp8 torchtitan; do [ -s "$OUT/$n.jsonl" ] && files+=("$OUT/$n.jsonl") && labels+=("$n"); done
  PYTHONPATH=$ROOT $PY -m meshtron.plot "${files[@]}" --labels "$(IFS=,; echo "${labels[*]}")" -o "$OUT/convergence.png"
}

for what in "$@"; do
  case $what in
    prepare) prepare ;;
    bf16) meshtron bf16 ;;
    fp8) meshtron fp8 --fp8 tensorwise ;;
    torchtitan) torchtitan ;;
    summary) summary ;;
    *) echo "unknown: $what (prepare, bf16, fp8, torchtitan, summary)"; exit 2 ;;
  esac
done
