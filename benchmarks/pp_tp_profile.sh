#!/bin/bash
# Where pp2 x tp2's step goes, beside dp2 x tp2 at the same global batch and micro-batch
# (issue 34, point 1): tokens/s and a profile (GPU kernels by kind, host time, GPU idle gaps)
# per layout, every rank. Four GPUs of one host:
#   OUT=$OUT bash benchmarks/pp_tp_profile.sh [layouts]
# Env: MODEL=llama-1B MB=4 GB=32 (global batch) SEQ=2048 T=500 (timeout s) PROFILE=2 (steps profiled)
#      TAG=prof (the results' folder, packed as $OUT/$TAG.tgz)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/pp_tp}
LAYOUTS=${1:-pp2tp2,tp2dp2,pp2tp2_nosp,pp2tp2_compile,tp2dp2_compile}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
TAG=${TAG:-prof}
mkdir -p "$OUT/$TAG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
python3 -c "import torch; print('torch', torch.__version__)"
timeout -k 20 "${T:-500}" python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
  "$ROOT/benchmarks/bench_train.py" --layouts "$LAYOUTS" --out "$OUT/$TAG" --model "${MODEL:-llama-1B}" \
  --untie-embeddings --seq-len "${SEQ:-2048}" --micro-batch "${MB:-4}" --global-batch "${GB:-32}" \
  --warmup 2 --steps 3 --rounds 3 --profile-steps "${PROFILE:-2}" 2>&1 | grep -v -i warn | grep -v '^{' | tail -30
python3 "$ROOT/benchmarks/bench_train.py" --summarize "$OUT/$TAG/results.jsonl"
tar -C "$OUT" -czf "$OUT/$TAG.tgz" "$TAG" && rm -rf "${OUT:?}/$TAG"
