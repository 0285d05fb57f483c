#!/bin/bash
# meshtron and torchtitan 0.2.2 on the same model, layouts and batch, in one call (issue 12).
#
# Prepare once on the CPU machine (the GPU machines cannot download), into the git-ignored .peer/:
#   cp -r ../shared/torchtitan-peer .peer && (cd .peer && python3 -m pip download --no-deps --only-binary=:all:
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
#     --platform manylinux2014_x86_64 -d whl torchtitan==0.2.2 torchdata==0.11.0 tokenizers==0.23.3 tyro==1.0.17
#     docstring_parser==0.18.0 typeguard==4.6.0 typing_extensions==4.16.0 tensorboard==2.21.0 protobuf==7.36.2
#     absl-py==2.5.1 && pip install tokenizers && python3 build_assets.py)
# Run on the GPU machine (device call with carry [".peer"]):
#   OUT=$OUT bash benchmarks/vs_torchtitan.sh 1gpu 1gpu_compile fsdp4 fsdp4_compile tp2dp2 tp2dp2_compile tp4 tp4_compile
# Env: MODEL=llama-1B (meshtron preset) TT_CONFIG=benchmarks/torchtitan/llama_1b.toml MB=16 (sequences a replica)
#      SEQ=2048 STEPS=20 (torchtitan; its tokens/s: the median of its LOG_FREQ=5-step windows after the first) T=300 (timeout per run)
#      ONLY=meshtron|torchtitan (one side only)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=${KIT:-$ROOT/.peer}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/vs_tt}
MODEL=${MODEL:-llama-1B}
TT_CONFIG=${TT_CONFIG:-$ROOT/benchmarks/torchtitan/llama_1b.toml}
MB=${MB:-16}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-20}
LOG_FREQ=${LOG_FREQ:-5}
T=${T:-300}
PY=${PY:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
mkdir -p "$OUT"

gpus_of() { case ${1%_compile} in 1gpu) echo 1 ;; fsdp2|tp2) echo 2 ;; *) echo 4 ;; esac; }
tt_flags() {  # torchtitan's equivalent of a meshtron layout
  local DP="--parallelism.data_parallel_shard_degree" TP="--parallelism.tensor_parallel_degree"
  local f
  case ${1%_compile} in
    1gpu) f="$DP 1" ;;
    fsdp4|fsdp4_zero3) f="$DP 4" ;;
    tp2dp2) f="$TP 2 $DP 2" ;;
    tp4) f="$TP 4 $DP 1 --training.dtype bfloat16" ;;   # no FSDP: torchtitan casts nothing itself
    *) return 1 ;;
  esac
  case $1 in *_compile) f="$f --compile.enable" ;; esac
  echo "$f"
}

if [ "${ONLY:-}" != "torchtitan" ]; then
  for N in 1 2 4; do
    L=$(for V in "$@"; do [ "$(gpus_of "$V")" = "$N" ] && printf "%s," "$V"; done)
    [ -n "$L" ] || continue
    echo "=== meshtron $MODEL on $N GPU(s): ${L%,}"
    timeout -k 20 $((T * 4)) $PY -m torch.distributed.run --standalone --nproc-per-node "$N" \
      "$ROOT/benchmarks/bench_train.py" --layouts "${L%,}" --out "$OUT" --model "$MODEL" --untie-embeddings \
      --seq-len "$SEQ" --micro-batch "$MB" 2>&1 | grep -v Warning | tail -${TAIL:-20}
  done
fi

if [ "${ONLY:-}" != "meshtron" ]; then
  STAMP=$(cd "$KIT/whl" && ls *.whl | md5sum | cut -c1-12)
  if [ "$(cat "$SITE/.tt3_stamp" 2>/dev/null)" != "$STAMP" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/whl/*.whl \
      && echo "$STAMP" > "$SITE/.tt3_stamp"
  fi
  for V in "$@"; do
    F=$(tt_flags "$V") || { echo "=== torchtitan: no equivalent of $V"; continue; }
    N=$(gpus_of "$V")
    LOG=$OUT/tt_$V.log
    echo "=== torchtitan $V on $N GPU(s)"
    PYTHONPATH=$SITE:$KIT/shim:$ROOT/benchmarks/torchtitan PYTORCH_ALLOC_CONF=expandable_segments:True \
      timeout -k 20 "$T" $PY -m torch.distributed.run --standalone --nproc-per-node "$N" --local-ranks-filter 0 \
      -m torchtitan.train --job.config_file "$TT_CONFIG" --model.hf_assets_path "$KIT/tokenizer" \
      --training.dataset_path "$KIT/data/c4_test" --job.dump_folder "/tmp/tt_out/$V" --training.steps "$STEPS" \
      --metrics.log_freq "$LOG_FREQ" --training.seq_len "$SEQ" --training.local_batch_size "$MB" $F > "$LOG" 2>&1
    echo "rc=$?"; grep -E "step: *[0-9]+ +loss" "$LOG" | sed 's/^.*INFO - //' | tail -2
    grep -E "Error|error:|OutOfMemory" "$LOG" | grep -vi warn | tail -3 | cut -c1-300
    $PY - "$V" "$N" "$LOG" >> "$OUT/torchtitan.jsonl" <<'PYEOF'
import json, re, sys
layout, world, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import statistics
lines = [l for l in open(log) if re.search(r"step: *\d+ +loss", l)]
def num(key, l):
    m = re.search(key + r":\s*([\d,.]+)", l)
    return float(m.group(1).replace(",", "")) if m else None
# every window after the first (which holds compilation): TP windows swing 20%, so the median of them
windows = [num("tps", l) for l in lines[1:]] or [None]
last = lines[-1] if lines else ""
print(json.dumps(dict(layout=layout, world=world,
                      tokens_per_s_per_gpu=statistics.median(windows) if windows[0] else num("tps", last),
                      tps_windows=windows, peak_mem_gib=num("memory", last), tflops_per_gpu=num("tflops", last),
                      mfu=(num("mfu", last) or 0) / 100, line=last.strip())))
PYEOF
  done
fi
echo "=== meshtron against torchtitan 0.2.2 ($MODEL, seq $SEQ, $MB sequences a replica, bf16)"
$PY "$ROOT/benchmarks/bench_train.py" --summarize "$OUT/results.jsonl" --peer "$OUT/torchtitan.jsonl"
