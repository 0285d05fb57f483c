#!/bin/bash
# One call on four GPUs of one host (carry .peer), 2026-11-28: issue 42's rows never run, from the repo root:
#   bash benchmarks/results/2026-11-28-4xh100-moe/call.sh
# 1. torchtitan moe_ep4_compile (35 steps), then meshtron's `ep4` suite row --ep 4 --zero 1 with --extra=--compile:
#    the compiled-to-compiled ratio.
# 2. The expert load max/mean by layer over 50 steps under --ep 4 (benchmarks/moe_balance.py under torchrun, the
#    llama-moe-3B preset's routing); beside it the masked rows' data is built (/tmp/c4_idx).
# 3. cp=4 at 128K with --document-mask: the `cp4` suite's 128K row with --extra (the kit's c4_test as a Megatron
#    dataset, file order, --cp-comm a2a: the only CP path that takes the mask), torchtitan's cp4_128k with the
#    flavor tt3_8l_flex (tt_cp_flex.py: flex + block_causal, the ptrr load balancer; headtail if ptrr fails), then
#    the same meshtron row causal (no mask) on the same data.
# Jobs run one after another, each only if the call's time (BUDGET s) still holds it. DRY=1 prints the jobs only.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True
HERE=benchmarks/results/2026-11-28-4xh100-moe
R=${R:-/tmp/moe1}
OUT=${OUT:-/tmp/moe1out}
BUDGET=${BUDGET:-540}
SKIP=${SKIP:-}
DRY=${DRY:-}
DATA=/tmp/c4_idx/c4_test
mkdir -p $R $OUT
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
TO=0
gate() {   # tag, seconds it needs at least, timeout s: sets TO, or fails (skip)
  local tag=$1 need=$2 to=$3 l
  [[ " $SKIP " == *" $tag "* ]] && return 1
  l=$(left)
  if (( l < need )); then echo "[$(( $(date +%s) - T0 )) s] skip $tag (${l} s left)" | tee -a $R/times.txt; return 1; fi
  (( to > l )) && to=$l
  TO=$to
  echo "[$(( $(date +%s) - T0 )) s] start $tag (timeout $TO s)" | tee -a $R/times.txt
}
done_() { echo "[$(( $(date +%s) - T0 )) s] end $1 rc=$2" | tee -a $R/times.txt; }
steps_of() {   # tag, torchtitan variant: its logged steps from the kit's full log, and the log itself
  grep -E "step: *[0-9]+ +loss" /tmp/tt3_logs/$2.log | sed 's/^.*root - INFO - //' > $R/$1.steps
  cp /tmp/tt3_logs/$2.log $R/$1.ttlog
}
st() {   # tag, need, timeout, suite args... (a suite run into $R/tag)
  local tag=$1 need=$2 to=$3; shift 3
  gate $tag $need $to || return 1
  if [ -n "$DRY" ]; then echo "  python3 benchmarks/suite.py $* --timeout $TO"; return 0; fi
  env OUT=$R/$tag timeout -k 30 $(( TO + 20 )) python3 benchmarks/suite.py "$@" --timeout $TO > $R/$tag.out 2>&1
  done_ $tag $?
}
tt() {   # tag, need, timeout, row name, variant, steps (the kit directly, for variants no suite row names)
  local tag=$1 need=$2 to=$3 name=$4 v=$5 n=$6
  gate $tag $need $to || return 1
  if [ -n "$DRY" ]; then echo "  TT3_ARGS='${TT3_ARGS:-}' STEPS=$n bash .peer/run.sh $v"; return 0; fi
  STEPS=$n LOG_FREQ=5 T=$TO T_COMPILE=$TO bash .peer/run.sh $v > $R/$tag.out 2>&1
  done_ $tag $?
  steps_of $tag $v
  python3 $HERE/rows.py peer $R/$tag "$name" $v 4 $R/$tag.steps
}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
torch.cuda.nccl.version(), "triton", triton.__version__)'
  nproc; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
cat $R/env.txt

# 1. MoE, compiled, both sides
M="--profile-steps 2 --rounds 5 --round-steps 4"
tt tt_ep4_compile 90 150 "torchtitan dp4 x ep4, compiled" moe_ep4_compile 35
st mt_ep4_compile 70 140 ep4 --only="--ep 4 --zero 1" $M --extra=--compile

# 2. the expert load over 50 steps under --ep 4; the data of 3 built beside it (its own CPU processes)
if [ -z "$DRY" ] && [ ! -f $DATA.idx ]; then
  python3 -m meshtron.data.prepare .peer/data/c4_test/data.json --output-prefix $DATA --tokenizer .peer/tokenizer \
    --workers 8 > $R/prepare.out 2>&1 &
  PREP=$!
fi
if gate balance 60 120; then
  B="--model llama-moe-3B --seq-len 2048 --micro-batch 4 --dtype bf16 --steps 50 --every 1 --ep 4 --zero 1"
  if [ -n "$DRY" ]; then echo "  torchrun --nproc-per-node 4 --local-ranks-filter 0 benchmarks/moe_balance.py $B"
  else
    timeout -k 20 $TO python3 -m torch.distributed.run --standalone --nproc-per-node 4 --local-ranks-filter 0 \
      benchmarks/moe_balance.py $B > $R/balance.out 2>&1
    done_ balance $?
  fi
fi
[ -n "${PREP:-}" ] && { wait $PREP; echo "prepare rc=$? ($(tail -1 $R/prepare.out))" | tee -a $R/times.txt; }

# 3. cp=4, 128K, document mask: meshtron (a2a), torchtitan flex + block_causal, meshtron causal on the same data
DX="--data $DATA --no-shuffle --cp-comm a2a"
st mt_cp4_128k_mask 60 130 cp4 --only "128K, cp4 (ring)" --profile-steps 2 --rounds 4 --round-steps 4 \
  --extra="$DX --document-mask"
FLEX="--model.flavor tt3_8l_flex --experimental.custom_import tt_cp_flex"
PYTHONPATH=$PWD/$HERE TT3_ARGS="$FLEX --parallelism.context_parallel_load_balancer ptrr" \
  tt tt_cp4_128k_flex 90 170 "torchtitan cp4 128K, flex + block_causal" cp4_128k 30
if [ -z "$DRY" ] && [ -f $R/tt_cp4_128k_flex.out ] && [ ! -s $R/tt_cp4_128k_flex.steps ] \
    && grep -iE "error|exception" $R/tt_cp4_128k_flex.ttlog | grep -qiE "ptrr|load.?balancer"; then
  PYTHONPATH=$PWD/$HERE TT3_ARGS="$FLEX --parallelism.context_parallel_load_balancer headtail" \
    tt tt_cp4_128k_flex_ht 90 170 "torchtitan cp4 128K, flex + block_causal (headtail)" cp4_128k 30
fi
st mt_cp4_128k_a2a 60 120 cp4 --only "128K, cp4 (ring)" --profile-steps 0 --rounds 4 --round-steps 4 --extra="$DX"

[ -n "$DRY" ] && exit 0
python3 $HERE/rows.py merge $R/results.jsonl $R
for f in $R/tt_*.steps; do echo "== $(basename $f)"; cat $f; done > $OUT/tt_steps.txt 2>/dev/null
cp $R/results.jsonl $R/env.txt $R/times.txt $R/balance.out $OUT/ 2>/dev/null
(cd $R && tar czf $OUT/logs.tgz $(ls *.out *.ttlog */*.log */*/profile_*_r0.txt 2>/dev/null))
{ python3 $HERE/rows.py summary $R/results.jsonl; echo "== balance (--ep 4)"; python3 $HERE/rows.py balance \
  $R/balance.out; } 2>&1 | tee $OUT/summary.txt
grep -h -i -B2 -A6 "Traceback\|OutOfMemory" $R/*/*.log $R/*.ttlog $R/balance.out 2>/dev/null | tail -40
