#!/usr/bin/env bash
# GPU round 5 (1 x H200): BERT-large LoRA with and without lora_fusion next to peft (issue 5), and where
# the serial BERT step's host time goes after round 4 (cProfile). Run from the repository root with $OUT set.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
timeout 200 python3 bench/bench_plans.py --world 1 --preset bert-large --seq 1024 --batch 8 --dtype bfloat16 --steps 10 --warmup 3 \
  --override max_position_embeddings=1024 --override lora_dim=16 --override lora_alpha=32 \
  --plans "none,hf@tuning=lora,none@tuning=lora,none@tuning=lora@lora_fusion=true" --json $OUT/bert_large_lora_fusion.json 2>&1 | grep -v Warn | tail -6
timeout 150 python3 bench/profile_host.py --preset bert-large --seq 512 --batch 8 --steps 12 --rows 25 --out $OUT 2>&1 | grep -A32 "==== galaxy" | head -34
