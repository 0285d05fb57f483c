#!/bin/bash
# torchtitan throughput variants, offline, for a side-by-side with meshtron.
# Kit: this folder (configs, flavors, datasets stand-in) + whl/, tokenizer/, data/ built per README.md
# (here, or in ASSETS: the checkout's git-ignored .peer/ where they were built there). torchtitan 0.2.2:
# 0.3.0 cannot import on the GPU machine's torch 2.11 (needs torch >= 2.12: fsdp.DataParallelMeshDims).
#
# Run on the GPU machine (see README.md):
#   run.sh llama1b_1gpu_compile cp4_128k moe_ep4
#   run.sh list                # the variants and their exact commands
#   (or `bash run.sh ...` where the file lost its executable bit)
# Env: T=150 (timeout s per variant; T_COMPILE=240 for *compile* variants, whose
#      first step compiles)  STEPS=20  LOG_FREQ=5  SITE=/tmp/site (wheel target)
#      TT3_ARGS="..." extra torchtitan CLI overrides appended to every variant (the last
#      occurrence of a flag wins), e.g. TT3_ARGS="--training.local_batch_size 8"
#      LOG_RANK=0 (rank whose output is shown; all ranks' logs stay in /tmp/tt3_logs/<v>.ranks)
#      OUT: if set to a folder, logs are copied there.
#      TT3_ENTRY=torchtitan.train (the CPU check substitutes tt3_cpu_train)
set -u
KIT=${KIT:-$(cd "$(dirname "$0")" && pwd)}
ASSETS=${ASSETS:-$KIT}   # whl/, tokenizer/, data/
SITE=${SITE:-/tmp/site}
T=${T:-150}
T_COMPILE=${T_COMPILE:-240}
STEPS=${STEPS:-20}
LOG_FREQ=${LOG_FREQ:-5}
ENTRY=${TT3_ENTRY:-torchtitan.train}
LOGS=/tmp/tt3_logs
PY=${PY:-python3}

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false HF_DATASETS_CACHE=/tmp/tt3_hf_cache HF_HOME=/tmp/tt3_hf_home
# torchtitan's own launcher (run_train.sh) sets this allocator mode:
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# --- variants: name -> "nproc config extra-args" -------------------------------------
# Each runs `python3 -m torch.distributed.run` (= torchrun, from the same interpreter)
# with `-m torchtitan.train --job.config_file configs/<config> <args>`.
spec() {
  local C="cp_8l.toml" M="moe_qwen3.toml" L="llama1b.toml"
  local DP="--parallelism.data_parallel_shard_degree" TP="--parallelism.tensor_parallel_degree"
  local CP="--parallelism.context_parallel_degree" EP="--parallelism.expert_parallel_degree"
  local SL="--training.seq_len" CO="--compile.enable" BF="--training.dtype bfloat16"
  case $1 in
    # TP without FSDP: torchtitan 0.2.2 applies no mixed precision, so the tp variants set $BF
    # (d) Llama 3.2 1B shape, 16 x 2048 per replica (meshtron's llama-1B --untie-embeddings)
    llama1b_1gpu)            echo "1 $L" ;;
    llama1b_1gpu_compile)    echo "1 $L $CO" ;;
    # FP8 (torchao Float8Linear, torchtitan's converter; compiled as torchtitan advises); output head kept bf16
    llama1b_1gpu_fp8)        echo "1 $L $CO --model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns output" ;;
    llama1b_1gpu_fp8_rowwise) echo "1 $L $CO --model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name rowwise --quantize.linear.float8.filter_fqns output" ;;
    llama3b_1gpu_compile)    echo "1 $L $CO --model.flavor tt3_llama3b --training.local_batch_size 8" ;;
    llama3b_1gpu_fp8)        echo "1 $L $CO --model.flavor tt3_llama3b --training.local_batch_size 8 --model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns output" ;;
    llama1b_fsdp4)           echo "4 $L $DP 4" ;;
    llama1b_fsdp4_compile)   echo "4 $L $DP 4 $CO" ;;
    llama1b_tp2fsdp2_compile) echo "4 $L $TP 2 $DP 2 $CO" ;;
    llama1b_tp4_compile)     echo "4 $L $TP 4 $DP 1 $BF $CO" ;;
    # two GPUs (a machine of two): the same model under tp2 and fsdp2
    llama1b_tp2_compile)     echo "2 $L $TP 2 $DP 1 $BF $CO" ;;
    llama1b_fsdp2_compile)   echo "2 $L $DP 2 $CO" ;;
    # FP8 on four GPUs (tensorwise; FSDP all-gathers the weights in float8 with scales precomputed after the optimizer step)
    llama1b_fsdp4_fp8)       echo "4 $L $DP 4 $CO --model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output --quantize.linear.float8.enable_fsdp_float8_all_gather --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp" ;;
    llama1b_tp2fsdp2_fp8)    echo "4 $L $TP 2 $DP 2 $CO --model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output --quantize.linear.float8.enable_fsdp_float8_all_gather --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp" ;;
    llama1b_tp4_fp8)         echo "4 $L $TP 4 $DP 1 $BF $CO --model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns output" ;;
    # Llama 3.1 8B shape, FSDP over four GPUs (TT3_ARGS sets the batch)
    llama8b_fsdp4_compile)   echo "4 $L $DP 4 $CO --model.flavor tt3_llama8b" ;;
    llama8b_fsdp4_fp8)       echo "4 $L $DP 4 $CO --model.flavor tt3_llama8b --model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output --quantize.linear.float8.enable_fsdp_float8_all_gather --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp" ;;
    # (b) context parallelism: 8-layer dim-2048 model, batch 1
    cp1_16k)                 echo "1 $C $SL 16384" ;;
    cp1_32k)                 echo "1 $C $SL 32768" ;;
    cp1_64k)                 echo "1 $C $SL 65536 --activation_checkpoint.mode full" ;;
    cp1_64k_noac)            echo "1 $C $SL 65536" ;;
    cp2_32k)                 echo "2 $C $CP 2 $SL 32768" ;;
    cp2_64k)                 echo "2 $C $CP 2 $SL 65536" ;;
    cp4_32k)                 echo "4 $C $CP 4 $SL 32768" ;;
    cp4_64k)                 echo "4 $C $CP 4 $SL 65536" ;;
    cp4_128k)                echo "4 $C $CP 4 $SL 131072" ;;
    # (c) MoE qwen3-style 16 experts top-2 (2.78B total), seq 2048, 4 samples/rank
    moe_1gpu)                echo "1 $M" ;;
    moe_fsdp4)               echo "4 $M $DP 4" ;;
    moe_ep2)                 echo "4 $M $DP 4 $EP 2" ;;
    moe_ep2_2gpu)            echo "2 $M $DP 2 $EP 2" ;;
    moe_ep4)                 echo "4 $M $DP 4 $EP 4" ;;
    moe_ep4_compile)         echo "4 $M $DP 4 $EP 4 $CO" ;;
    *) return 1 ;;
  esac
}
ALL="llama1b_1gpu llama1b_1gpu_compile llama1b_1gpu_fp8 llama1b_1gpu_fp8_rowwise
 llama3b_1gpu_compile llama3b_1gpu_fp8 llama1b_fsdp4 llama1b_fsdp4_compile llama1b_tp2fsdp2_compile llama1b_tp4_compile llama1b_tp2_compile llama1b_fsdp2_compile llama1b_fsdp4_fp8 llama1b_tp2fsdp2_fp8 llama1b_tp4_fp8 llama8b_fsdp4_compile llama8b_fsdp4_fp8 cp1_16k cp1_32k cp1_64k cp1_64k_noac cp2_32k
 cp2_64k cp4_32k cp4_64k cp4_128k moe_1gpu moe_fsdp4 moe_ep2 moe_ep2_2gpu moe_ep4 moe_ep4_compile"

cmd_of() {  # variant -> full command line (words)
  local s n cfg
  s=$(spec "$1") || return 1
  set -- $s
  n=$1 cfg=$2
  shift 2
  echo "$PY -m torch.distributed.run --nproc-per-node $n --rdzv-backend c10d --rdzv-endpoint localhost:0" \
       "--local-ranks-filter ${LOG_RANK:-0} --role rank --tee 3 --log-dir $LOGS/$V.ranks" \
       "-m $ENTRY --job.config_file $KIT/configs/$cfg" \
       "--model.hf_assets_path $ASSETS/tokenizer --training.dataset_path $ASSETS/data/c4_test" \
       "--job.dump_folder /tmp/tt3_out/$V --training.steps $STEPS --metrics.log_freq $LOG_FREQ" \
       "$* ${TT3_ARGS:-}"
}

if [ $# -eq 0 ] || [ "$1" = "list" ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  echo "usage: run.sh VARIANT [VARIANT ...]   (KIT=this folder)"
  for V in $ALL; do s=$(spec $V); echo "  $V  [nproc ${s%% *}]: $(cmd_of $V)"; done
  exit 0
fi
for V in "$@"; do spec "$V" >/dev/null || { echo "unknown variant: $V (run.sh list)"; exit 2; }; done

# --- install the kit's wheels (once per wheel set) ------------------------------------
STAMP=$(cd "$ASSETS/whl" && ls *.whl | md5sum | cut -c1-12)
if [ "$(cat "$SITE/.tt3_stamp" 2>/dev/null)" != "$STAMP" ]; then
  echo "installing $(ls "$ASSETS"/whl/*.whl | wc -l) wheels into $SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$ASSETS"/whl/*.whl || { echo "wheel install failed"; exit 3; }
  echo "$STAMP" > "$SITE/.tt3_stamp"
fi
# torchtitan imports `datasets` at module level; the real one (pyarrow, pandas, ...) is
# too big for the kit, so shim/ holds a ~110-line local-JSON stand-in. It shadows any
# installed `datasets` (same behaviour everywhere) unless TT3_REAL_DATASETS=1.
SHIM=$KIT/shim
[ "${TT3_REAL_DATASETS:-0}" = "1" ] && SHIM=""
export PYTHONPATH=$SITE:$KIT/py${SHIM:+:$SHIM}${PYTHONPATH:+:$PYTHONPATH}
[ "$ENTRY" = "torchtitan.train" ] || export PYTHONPATH=$PYTHONPATH:$KIT/cpu_check

mkdir -p "$LOGS"
command -v nvidia-smi >/dev/null && nvidia-smi -L
$PY -c "import torch, torchtitan, tyro, tokenizers, torchdata; print('torch', torch.__version__, \
'| torchtitan', torchtitan.__version__, '| cuda', torch.version.cuda, '| gpus', torch.cuda.device_count())" \
  || { echo "torchtitan does not import (see above)"; exit 4; }
NGPU_HERE=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

SUMMARY=""
for V in "$@"; do
  CMD=$(cmd_of "$V")
  LOG=$LOGS/$V.log
  NP=$(spec "$V"); NP=${NP%% *}
  if [ "$ENTRY" = "torchtitan.train" ] && [ "$NP" -gt "$NGPU_HERE" ]; then
    echo; echo "=== $V skipped: needs $NP GPUs, $NGPU_HERE visible"
    SUMMARY+=$(printf "%-24s skipped (needs %s GPUs)" "$V" "$NP")$'\n'
    continue
  fi
  case $V in *compile*) TV=$T_COMPILE ;; *) TV=$T ;; esac
  rm -rf "$LOGS/$V.ranks" "/tmp/tt3_out/$V"
  echo
  echo "=== $V  (timeout ${TV}s)"
  echo "\$ $CMD"
  t0=$(date +%s)
  timeout -k 20 "$TV" $CMD > "$LOG" 2>&1
  rc=$?
  wall=$(( $(date +%s) - t0 ))
  [ $rc -eq 124 ] && note="TIMEOUT" || note=""
  echo "rc=$rc $note wall=${wall}s  log: $LOG"
  grep -E "size: [0-9,]+ total parameters|memory usage for model|Peak FLOPS used" "$LOG" | sed 's/^.*root - INFO - /  /' | head -3
  grep -E "step: *[0-9]+ +loss" "$LOG" | sed 's/^.*root - INFO - /  /' | tail -${TAIL:-4}
  if [ $rc -ne 0 ]; then
    grep -E "Error|error:|OutOfMemory|CUDA out of memory|Traceback|exitcode" "$LOG" | grep -v -i warn | tail -6 | cut -c1-300
  fi
  last=$(grep -E "step: *[0-9]+ +loss" "$LOG" | tail -1 | sed 's/^.*root - INFO - //')
  SUMMARY+=$(printf "%-24s rc=%-3s %s" "$V" "$rc" "${last:-no step logged}")$'\n'
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$LOG" "$OUT/tt3_$V.log" 2>/dev/null
    { echo "=== $V rc=$rc: $CMD"; cat "$LOG"; } >> "$OUT/tt3_all.log" 2>/dev/null
  fi
done
echo
echo "=== summary (last logged step: tps = tokens/s per GPU over the last $LOG_FREQ steps, memory = peak"
echo "    reserved GiB since the previous log line, mfu against the 'Peak FLOPS used' line above)"
printf "%s" "$SUMMARY"
