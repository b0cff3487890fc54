#!/usr/bin/env bash
# Long-context memory of a LoRA / QLoRA step on one GPU (issue 50 items 1-2): bench/long_context_memory.py at
# 32k, 64k and 128k tokens, Llama-3.2-1B shapes (bench_lora's Galaxy contender: LoRA r16 on q/v, bf16, compiled).
# For each length: the memory model's per-layer bytes of every layer memory mode and its predicted peaks, the
# auto plan within BUDGET_GIB (default 5.7: unsloth-lora-gc-sdpa's 5,849 MiB at 32k), then MODES trained (peak
# allocated memory, step time, tokens/s, loss), the largest tensors of one eager step, and a torch.cuda.memory
# snapshot of each measured step under $OUT/snapshots (open in https://pytorch.org/memory_viz). Each measured
# mode compiles its layers once (about a minute) and runs 3 steps, so one call takes one or two lengths within
# the 10-minute limit; SEQS / MODES / BUDGET_GIB / CHUNKS / QUANTIZE change the launch:
#   bash bench/device/long_context_memory.sh                                        # LoRA at 32k and 64k
#   SEQS=131072 bash bench/device/long_context_memory.sh                            # LoRA at 128k
#   QUANTIZE=nf4 BUDGET_GIB=4.4 bash bench/device/long_context_memory.sh            # QLoRA (unsloth's 4,504 MiB)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/long_context}
mkdir -p "$OUT"
QUANTIZE=${QUANTIZE:-none}
SEQS=${SEQS:-32768 65536}
MODES=${MODES:-auto mlp+offload full+offload}
BUDGET_GIB=${BUDGET_GIB:-5.7}
CHUNKS=${CHUNKS:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
# shellcheck disable=SC2086
timeout 570 python3 bench/long_context_memory.py --preset llama-1b --seqs $SEQS --quantize "$QUANTIZE" \
  --budget_gib "$BUDGET_GIB" --mlp_chunks "$CHUNKS" --measure --modes $MODES --largest full+offload \
  --warmup 1 --steps 2 \
  --memory_history "$OUT/snapshots" --json "$OUT/long_context_${QUANTIZE}.json" 2>&1 | grep -v Warn
