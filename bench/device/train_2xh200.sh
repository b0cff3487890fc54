#!/bin/bash
# The real comparison (issue 14, build item 1) on nvidia-h200-x2. Each scenario is one torchrun launch;
# a `run` command may last 10 minutes, so call once per scenario (device time: about 8 + 10 minutes):
#   run kind nvidia-h200-x2, carry [".carry/harness"], command:
#     cd .carry/harness && bash bench/device/train_2xh200.sh stack4
#     cd .carry/harness && bash bench/device/train_2xh200.sh llama7b
# (prepare the carry first, here: bash bench/device/prepare_carry.sh /work/main harness)
set -o pipefail
case ${1:?stack4 or llama7b} in
    stack4)  exec timeout 580 bash bench/device/train_harness.sh 2 stack4 --warmup 3 --iters 10 ;;
    # 7B: the serial contenders need ~110 GB for fp32 masters + AdamW alone and galaxy-none the same; the
    # compiled-off Galaxy variants beyond after_backward are left to the stack4 run to fit 10 minutes.
    llama7b) exec timeout 580 bash bench/device/train_harness.sh 2 llama7b --warmup 2 --iters 6 \
                 --skip 'serial-*,galaxy-none,galaxy-*-overlap,galaxy-*-sharded' ;;
    *) echo "unknown scenario $1 (stack4 | llama7b)"; exit 2 ;;
esac
