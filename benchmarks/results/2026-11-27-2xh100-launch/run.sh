#!/bin/bash
# meshtron-run's (meshtron.launch) forked ranks on GPUs: CUDA, NCCL, the allocator setting, compile, and start-up time against torchrun.
# bash benchmarks/results/2026-11-27-2xh100-launch/run.sh   (from the repository root, two GPUs)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
D=benchmarks/results/2026-11-27-2xh100-launch
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())"
for L in meshtron.launch torch.distributed.run; do
  echo "== $L check_rank"; python3 -m $L --nproc-per-node 2 $D/check_rank.py 2>&1 | grep -v "^W1\|^\s*$" | tail -4
done
for i in 1 2; do for L in meshtron.launch torch.distributed.run; do
  s=$(date +%s.%N)
  python3 -m $L --nproc-per-node 2 recipes/train.py --model llama-tiny --dp 2 --steps 20 --compile > $OUT/train_${L}_$i.log 2>&1; rc=$?
  e=$(date +%s.%N)
  echo "$L run $i: rc=$rc wall $(python3 -c "print(round($e-$s,1))") s | $(grep -m1 '^step ' $OUT/train_${L}_$i.log | cut -c1-60) | $(tail -1 $OUT/train_${L}_$i.log | cut -c1-100)"
done; done
echo "== async checkpoints from forked ranks"
python3 -m meshtron.launch --nproc-per-node 2 recipes/train.py --model llama-tiny --dp 2 --zero 3 --steps 6 \
    --checkpoint-dir /tmp/ck-async --checkpoint-interval 3 --checkpoint-async 2>&1 | grep -v "^W1" | tail -4
ls /tmp/ck-async
