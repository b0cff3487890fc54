#!/usr/bin/env bash
# GPU round 6 (2 x H200; the 4-GPU lines run only where 4 GPUs are present): what issue 6 still needs.
# 1. CCLoRA vs LoRA at TP 2 with kernel tables (--profile), with and without LoRA dropout, to price
#    the W + B(sA) merge GEMMs the round-5 profile pointed at; 2. CoC 1 vs 2 with NCCL's protocol
#    left to NCCL and forced to Simple / LL128; 3. the 4-GPU stack (scaling efficiency >= 0.80).
# Run from the repository root with $OUT and GALAXY_COMMIT set.
set -uo pipefail
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
mkdir -p $OUT/profile $OUT/profile_dropout
timeout 180 python3 bench/bench_cclora.py --world 2 --iters 15 --warmup 3 --profile $OUT/profile \
  --out $OUT/cclora.json 2>&1 | grep -v Warn | tail -12
timeout 180 python3 bench/bench_cclora.py --world 2 --iters 15 --warmup 3 --dropout 0.05 --profile $OUT/profile_dropout \
  --out $OUT/cclora_dropout.json 2>&1 | grep -v Warn | tail -12
for proto in default Simple LL128; do
  env=(); [ "$proto" != default ] && env=(--env NCCL_PROTO=$proto)
  timeout 150 python3 bench/bench_coc.py --world 2 --plans galaxy2,galaxy --coc 1,2 --coc-source model --iters 12 \
    --warmup 3 "${env[@]}" --json $OUT/coc_$proto.json 2>&1 | grep -v Warn | tail -9
done
if [ "$GPUS" -ge 4 ]; then
  timeout 240 python3 bench/bench_coc.py --world 4 --plans tp,galaxy,galaxy2 --coc 1,2 --iters 12 --warmup 3 \
    --json $OUT/coc_4gpu.json 2>&1 | grep -v Warn | tail -12
fi
