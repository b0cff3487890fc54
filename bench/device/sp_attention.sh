#!/usr/bin/env bash
# The SP attention flavours (sp_attention: allgather | ring | ulysses) on 2 x H200: the ring's flash block kernel
# against the float64 reference, ring and Ulysses against allgather (fp32, bf16; causal zigzag, masks), then the
# attention core's forward + backward at 32k and 128k tokens with Llama-3.1-8B's heads (32 / 8 of 128).
# Needs kind nvidia-h200-x2. From the repository root with $OUT set (one call, a few minutes):
set -uo pipefail
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
timeout 280 python3 bench/device/sp_attention_check.py --world 2 --seq 32768 --json $OUT/sp_attention_w2_32k.json 2>&1 \
  | grep -v Warn | tail -40
timeout 280 python3 bench/device/sp_attention_check.py --world 2 --seq 131072 --no-check --json $OUT/sp_attention_w2_128k.json \
  2>&1 | grep -v Warn | tail -8
