#!/bin/bash
# Packed documents on four GPUs of one host (issue 37): meshtron's document mask (FlexAttention)
# against causal attention and against torchtitan 0.2.2's flex + block_causal flavor, every side of
# each comparison in one run; the suites (benchmarks/suite.py) cannot express its staged
# bench_documents.py runs nor the torchtitan flavor.
#
#   OUT=$OUT bash benchmarks/documents.sh            (the torchtitan kit in .peer/: ../shared/torchtitan-peer/README.md)
#
# Data: the torchtitan kit's c4_test (the Python standard library's sources, one document a
# JSON line) in the kit's tokenizer, as a Megatron dataset (built here if .peer/c4_idx lacks it);
# both trainers read it in file order, torchtitan through its own loader of the same JSON.
# Stage A, four one-GPU jobs side by side (CUDA_VISIBLE_DEVICES):
#   GPU 0  bench_documents.py --check (flex against one by one and the dense path), then
#          --attention --autotune (attention alone, each variant)
#   GPU 1  meshtron llama-1B 2 x 8192 causal (then 2 steps profiled), then torchtitan 0.2.2
#          causal (sdpa) on the same shape
#   GPU 2  meshtron llama-1B --document-mask (FlexAttention; then 2 steps profiled)
#   GPU 3  torchtitan flex + block_causal (flavor meshtron_llama1b_flex)
# Stage B, four GPUs: llama-617M at 64K, cp=4 Ulysses (a2a), causal then --document-mask, over
# every 64K sample of the data (48), then 2 steps profiled.
# Stage C, four one-GPU jobs side by side: meshtron llama-1B masked with torch's default flex tiles
# (GPU 0), with the shipped ones (GPU 1), causal (GPU 2), torchtitan flex (GPU 3), ROUNDS rounds.
# Env: PARTS="A B" (stages to run: A, B, C)  ROUNDS=3  TT_STEPS=5+5*ROUNDS  CP_FLAGS= (stage B)
#      T_MT=150 T_TT=240 T_CP=130 (timeouts, s)  A_DEADLINE=250
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
KIT=$ROOT/.peer
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/documents}
PARTS=${PARTS:-"A B"}
ROUNDS=${ROUNDS:-3}              # meshtron's timed 5-step rounds after 5 warm-up steps (stage C)
TT_STEPS=${TT_STEPS:-$(( 5 + 5 * ROUNDS ))}   # torchtitan's steps: its last ROUNDS 5-step windows are the same samples
CP_FLAGS=${CP_FLAGS:-}          # more recipe flags for stage B (--compile)
T_MT=${T_MT:-150}
T_TT=${T_TT:-240}
T_CP=${T_CP:-130}
A_DEADLINE=${A_DEADLINE:-250}   # stage A's seconds: the second job on a GPU gets what is left of them
PY=${PY:-python3}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTORCH_ALLOC_CONF=expandable_segments:True PYTHONPATH=$ROOT
DATA=$KIT/c4_idx/c4_test
RUN="$PY -m torch.distributed.run --standalone"
M1="--model llama-1B --untie-embeddings --seq-len 8192 --micro-batch 2 --global-batch 2 --data $DATA --compile"
M617="--model llama-617M --seq-len 65536 --micro-batch 1 --global-batch 1 --data $DATA"

nvidia-smi -L
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ ! -f "$DATA.idx" ]; then
  mkdir -p "$(dirname "$DATA")"
  $PY -m meshtron.data.prepare "$KIT/data/c4_test/data.json" --output-prefix "$DATA" --tokenizer "$KIT/tokenizer" \
    --workers 8 || exit 1
fi

mt() {  # GPU NAME [bench flags] -- [recipe flags]: meshtron's step, one GPU
  local gpu=$1 name=$2
  shift 2
  echo "=== [gpu $gpu] meshtron $name: $*"
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 20 "$T_MT" $RUN --nproc-per-node 1 benchmarks/bench_documents.py --train \
    --out "$OUT" "$@" > "$OUT/mt_$name.log" 2>&1
  echo "=== [gpu $gpu] meshtron $name rc=$?: $(grep -c '"step_ms"' "$OUT/mt_$name.log") result line(s)"
  grep -E "Error|error:|OutOfMemory" "$OUT/mt_$name.log" | grep -vi warn | tail -3 | cut -c1-300
}

tt() {  # GPU NAME FLAVOR: torchtitan 0.2.2, llama-1B 2 x 8192, compiled, one GPU
  local gpu=$1 name=$2 flavor=$3
  local cmd="$RUN --nproc-per-node 1 --local-ranks-filter 0 -m torchtitan.train --job.config_file
    $ROOT/benchmarks/torchtitan/llama_1b.toml --model.flavor $flavor --experimental.custom_import documents_flavors
    --model.hf_assets_path $KIT/tokenizer --training.dataset_path $KIT/data/c4_test --job.dump_folder /tmp/tt_out/$name
    --training.steps $TT_STEPS --metrics.log_freq 5 --training.seq_len 8192 --training.local_batch_size 2 --compile.enable"
  echo "=== [gpu $gpu] torchtitan $name: $cmd" | tr -s ' \n' ' '
  echo
  while [ ! -f /tmp/tt_installed ]; do sleep 2; done
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$SITE:$KIT/shim:$ROOT/benchmarks/torchtitan timeout -k 20 "$T_TT" $cmd \
    > "$OUT/tt_$name.log" 2>&1
  echo "=== [gpu $gpu] torchtitan $name rc=$?"
  grep -E "step: *[0-9]+ +loss" "$OUT/tt_$name.log" | sed 's/^.*INFO - //' | tail -4
  grep -E "Error|error:|OutOfMemory" "$OUT/tt_$name.log" | grep -vi warn | tail -3 | cut -c1-300
}

install_peer() {   # the kit's wheels, once per machine; then every torchtitan run may start (tt waits on the file)
  local stamp
  stamp=$(cd "$KIT/whl" && ls *.whl | md5sum | cut -c1-12)
  if [ "$(cat "$SITE/.tt3_stamp" 2>/dev/null)" != "$stamp" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/whl/*.whl \
      && echo "$stamp" > "$SITE/.tt3_stamp"
  fi
  touch /tmp/tt_installed
}

if [[ " $PARTS " == *" A "* ]]; then
  rm -f /tmp/tt_installed
  t0=$(date +%s)
  left() {   # what the second jobs may take (at least 1 s: `timeout 0` would mean none)
    local l=$(( t0 + A_DEADLINE - $(date +%s) ))
    [ "$l" -lt 1 ] && l=1
    echo "$l"
  }
  ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 100 $PY benchmarks/bench_documents.py --check --data "$DATA" \
      > "$OUT/check.log" 2>&1; echo "=== [gpu 0] check rc=$?"; grep -v -i warn "$OUT/check.log" | tail -8
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(left)" $PY benchmarks/bench_documents.py --attention --autotune \
      --data "$DATA" --out "$OUT" > "$OUT/attention.log" 2>&1
    echo "=== [gpu 0] attention rc=$?"; grep -v -i warn "$OUT/attention.log" | grep -E "^  |heads" ) &
  ( mt 1 causal --profile-steps 2 -- $M1; T_TT=$(left) tt 1 causal meshtron_llama1b ) &
  ( mt 2 flex --profile-steps 2 -- $M1 --document-mask ) &
  ( install_peer; tt 3 flex meshtron_llama1b_flex ) &
  wait
  echo "=== stage A: $(( $(date +%s) - t0 )) s"
fi

if [[ " $PARTS " == *" C "* ]]; then   # llama-1B side by side: the shipped tiles against torch's defaults
  rm -f /tmp/tt_installed
  t0=$(date +%s)
  ( mt 0 flex_default_tiles --rounds "$ROUNDS" --experiment default-tiles -- $M1 --document-mask ) &
  ( mt 1 flex --rounds "$ROUNDS" -- $M1 --document-mask ) &
  ( mt 2 causal --rounds "$ROUNDS" -- $M1 ) &
  ( install_peer; tt 3 flex meshtron_llama1b_flex ) &
  wait
  echo "=== stage C: $(( $(date +%s) - t0 )) s"
fi

if [[ " $PARTS " == *" B "* ]]; then
  for v in causal flex; do   # every 64K sample of the data: 3 warm-up steps, then 3 rounds of 15
    flags=""; [ $v = flex ] && flags="--document-mask"
    echo "=== cp4 a2a $v"
    timeout -k 20 "$T_CP" $RUN --nproc-per-node 4 benchmarks/bench_documents.py --train --out "$OUT" \
      --warmup 3 --window 15 --rounds 3 --profile-steps 2 -- $M617 --cp 4 --cp-comm a2a $flags $CP_FLAGS \
      > "$OUT/cp4_$v.log" 2>&1
    echo "=== cp4 a2a $v rc=$?: $(grep -c '"step_ms"' "$OUT/cp4_$v.log") result line(s)"
    grep -E "Error|error:|OutOfMemory" "$OUT/cp4_$v.log" | grep -vi warn | tail -3 | cut -c1-300
  done
fi

echo "=== results (documents.jsonl)"
$PY - "$OUT" <<'PYEOF'
import json, os, re, statistics, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(os.path.join(out, "documents.jsonl"))] if os.path.exists(os.path.join(out, "documents.jsonl")) else []
for r in rows:
    print(f"{r['model']:10s} w{r['world']} {r['experiment'] or '':7s} {'mask' if '--document-mask' in r['flags'] else 'causal':6s} "
          f"step {r['step_ms']:8.1f} ms rounds {[round(x, 1) for x in r['step_ms_rounds']]} tok/s/GPU {r['tokens_per_s_per_gpu']:9,.0f} "
          f"MFU {100 * (r['mfu'] or 0):5.1f}% peak {r['peak_mem_gib']:.1f}/{r['peak_reserved_gib']:.1f} GiB kept {r['kept_causal_share']} "
          f"mean doc {r['mean_doc_tokens_in_timed_samples']} losses {r['losses'][:3]}..{r['losses'][-2:]}")
    if r.get("profile"):
        print("    profile (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in r["profile"].items()))
for name in ("causal", "flex"):
    p = os.path.join(out, f"tt_{name}.log")
    if not os.path.exists(p):
        continue
    lines = [l for l in open(p) if re.search(r"step: *\d+ +loss", l)]
    tps = [float(re.search(r"tps: *([\d,]+)", l).group(1).replace(",", "")) for l in lines if "tps" in l]
    mem = [re.search(r"memory: *([\d.]+)GiB", l) for l in lines]
    n = (len(tps) - 2) if len(tps) > 2 else 0   # the windows of steps 6 on
    print(f"torchtitan {name}: tps windows {tps}, median of the last {n} {statistics.median(tps[-n:]) if n else None}, "
          f"memory {[m.group(1) for m in mem if m]}")
PYEOF
# the logs and profiles in one archive beside documents.jsonl
(cd "$OUT" && tar czf logs.tgz --exclude=log --exclude=logs.tgz --exclude=documents.jsonl -- * \
  && find . -mindepth 1 -maxdepth 1 ! -name log ! -name logs.tgz ! -name documents.jsonl -exec rm -rf {} +)
