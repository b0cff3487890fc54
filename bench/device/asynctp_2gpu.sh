#!/usr/bin/env bash
# Async TP (tp_overlap: async_tp) vs no overlap and CoC on the same plans, 2 x H200 (issue 14 build item 4).
# Needs kind nvidia-h200-x2: ask `status` first; run it once that kind is lent. From the repository root
# with $OUT set (one call, about 6 minutes):
#   1. the real symm_mem kernels across two GPUs equal the unfused path (edges and a small LLaMA, fp32 and bf16);
#   2. the 4 x LLaMA-7B-layer stack, fwd+bwd, plans galaxy and galaxy2: the model's own path (no overlap),
#      CoC 2 and 4 chunks, async TP -- same weights, same inputs, one launch ('vs k1' = speedup over none);
#   3. kernel tables of one rank's none and async_tp steps (where the matmuls and copies go on the timeline).
set -uo pipefail
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
timeout 200 python3 bench/device/asynctp_check.py --world 2 --iters 15 --profile $OUT/profile \
  --json $OUT/asynctp_check_w2.json 2>&1 | grep -v Warn | tail -16
timeout 300 python3 bench/bench_coc.py --world 2 --plans galaxy,galaxy2 --coc 1,2,4 --coc-source model \
  --skip-galaxy-serial --iters 20 --warmup 5 --json $OUT/asynctp_bench.json 2>&1 | grep -v Warn | tail -14
