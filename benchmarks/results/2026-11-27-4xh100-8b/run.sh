#!/bin/bash
# Issue 41 point 4 (llama-8B dp4 ZeRO-3, 2 x 2048 a rank, compiled) on 4 x H100, from the repo root:
#   bash benchmarks/results/2026-11-27-4xh100-8b/run.sh CALL     (CALL = 1 or 2; carry .peer)
# CALL 1: meshtron's variants with --profile-steps 2, then torchtitan llama8b_fsdp4_compile.
# CALL 2: the chosen variants, 30+ steps, and the peers (bf16, FP8) again.
set -u
CALL=${1:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
R=/tmp/r8b; OUT=${OUT:-/tmp/r8bout}; mkdir -p $R $OUT
T0=$(date +%s)
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print(torch.__version__, torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  git log --oneline -1 2>/dev/null; } > $R/env.txt 2>&1
cat $R/env.txt
# the kit's wheels (torchao for --fp8 too) into /tmp/site, once
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .peer/whl/*.whl \
  && (cd .peer/whl && ls *.whl | md5sum | cut -c1-12) > /tmp/site/.tt3_stamp
M8="--model llama-8B --seq-len 2048 --micro-batch 2 --global-batch 8"
mt() {   # tag, timeout s, bench_train args...
  local tag=$1 to=$2; shift 2
  echo "[$(( $(date +%s) - T0 )) s] start $tag" | tee -a $R/times.txt
  PYTHONPATH=/tmp/site timeout -k 20 $to python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
      benchmarks/bench_train.py --out $R/$tag "$@" $M8 > $R/$tag.log 2>&1
  echo "[$(( $(date +%s) - T0 )) s] end $tag rc=$?" | tee -a $R/times.txt
}
tt() {   # variant, timeout s
  echo "[$(( $(date +%s) - T0 )) s] start tt $1" | tee -a $R/times.txt
  OUT=$R STEPS=${TT_STEPS:-30} LOG_FREQ=5 T_COMPILE=$2 TT3_ARGS="--training.local_batch_size 2" \
      bash .peer/run.sh $1 > $R/tt_$1.out 2>&1
  echo "[$(( $(date +%s) - T0 )) s] end tt $1" | tee -a $R/times.txt
  grep -E "step: *[0-9]+ +loss" $R/tt3_$1.log | sed 's/^.*root - INFO - //' > $R/tt_$1.steps
}
if [ "$CALL" = 1 ]; then
  mt A 390 --warmup 3 --rounds 4 --steps 4 --profile-steps 2 \
    --layouts fsdp4_zero3_compile,fsdp4_zero3_pf2_compile,fsdp4_zero3_keep1_compile,fsdp4_zero3_compile+heads,fsdp4_zero3_bf16rs_compile,fsdp4_zero3_fp8_compile
  tt llama8b_fsdp4_compile $(( 585 - ($(date +%s) - T0) ))
else
  tt llama8b_fsdp4_compile 110
  tt llama8b_fsdp4_fp8 120
  mt B $(( 580 - ($(date +%s) - T0) )) --warmup 3 --rounds 7 --steps 4 --profile-steps 2 \
    --layouts ${LAYOUTS2:-fsdp4_zero3_compile,fsdp4_zero2_compile,fsdp4_zero3_fp8_compile,fsdp4_zero2_fp8_compile}
fi
cat $R/*/results.jsonl > $R/all.jsonl 2>/dev/null
cp $R/all.jsonl $R/env.txt $R/times.txt $OUT/ 2>/dev/null
cat $R/tt_*.steps > $OUT/tt_steps.txt 2>/dev/null
(cd /tmp && tar czf $OUT/logs.tgz r8b/*.log r8b/*/profile_*_r0.txt r8b/*/profile_*_r1.txt r8b/tt_*.out r8b/tt_*.steps 2>/dev/null)
python3 benchmarks/results/2026-11-27-4xh100-8b/summary.py $R/all.jsonl $OUT/tt_steps.txt | tee $OUT/summary.txt
grep -h -B2 -A3 "Traceback\|Error" $R/*.log 2>/dev/null | grep -v Warning | tail -30
