#!/usr/bin/env bash
# GPU round 4 (2 x H200): BERT host overhead and tuning memory after the fused-dropout change (issue 5),
# activation recomputation and the Triton kernels wired into llama-1b (issues 9, 6), CCLoRA (issue 6).
# Run from the repository root with $OUT and GALAXY_COMMIT set.
set -uo pipefail
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
timeout 150 python3 bench/bench_plans.py --world 2 --preset bert-large --seq 512 --batch 8 --dtype bfloat16 \
  --plans none,hf --steps 15 --warmup 5 --json $OUT/bert_large_b8_host.json 2>&1 | grep -v Warn | tail -4
timeout 170 python3 bench/bench_plans.py --world 2 --preset bert-large --seq 1024 --batch 8 --dtype bfloat16 --steps 8 --warmup 3 \
  --override max_position_embeddings=1024 --override lora_dim=16 --override lora_alpha=32 \
  --plans "none,hf,none@tuning=lora,hf@tuning=lora,none@tuning=side" --json $OUT/bert_large_tuning.json 2>&1 | grep -v Warn | tail -7
timeout 150 python3 bench/bench_cclora.py --world 2 --iters 15 --warmup 3 --out $OUT/cclora.json 2>&1 | grep -v Warn | tail -14
timeout 200 python3 bench/bench_recompute.py --batch 8 --steps 6 --warmup 2 --out $OUT/recompute.json 2>&1 | grep -v Warn | tail -8
timeout 80 python3 bench/bench_recompute.py --batch 8 --steps 6 --warmup 2 --modes none --kernels torch \
  --out $OUT/recompute_torch_kernels.json 2>&1 | grep -v Warn | tail -4
