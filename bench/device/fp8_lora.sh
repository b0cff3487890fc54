#!/bin/bash
# The fp8 LoRA table (issue 50) on one H200: bench/bench_lora.py's fp8 contenders (another engineer's, named with
# "fp8": their family in the report's summary) beside the bf16-base rows they are read against, Galaxy's compiled
# LoRA and unsloth's LoRA with both attention paths (its faster row is the family's anchor), in one launch:
# Llama-3.2-1B shapes, seq 1024, batch 8, LoRA r16 on q/v, 20 timed steps after 3. Carry and deps as
# lora_unsloth.sh (its header):
#   WHEELS=unsloth bash bench/device/prepare_carry.sh /work/main lora        # -> /work/main/.carry/lora
# On nvidia-h200, carry [".carry/lora"], FP8_CONTENDERS naming the fp8 rows (bench_lora.py's CONTENDERS list them
# once they are in), e.g.:
#   cd .carry/lora && FP8_CONTENDERS=galaxy-lora-fp8-compiled bash bench/device/fp8_lora.sh start \
#       && bash bench/device/fp8_lora.sh wait
#   cd .carry/lora && bash bench/device/fp8_lora.sh wait          # again, at once, until it prints "done"
# Expected wall time (an estimate, not measured): ~1 min a Galaxy contender, ~1.5 min an unsloth one: ~5 min for
# the three bf16 rows and ~1 min for each fp8 row. PRESET=llama-8b BATCH=2 for the 8B shapes (~3x as long).
set -o pipefail
source "$(dirname "$0")/detached.sh"
source "$(dirname "$0")/lora_deps.sh"
mode=${1:?start|wait|collect}; polls=${POLLS:-50}  # 10 s polls
dir=/root/fp8_lora; deps=$dir/deps; mkdir -p "$dir"
if [ "$mode" = start ]; then
    fp8=${FP8_CONTENDERS:?name the fp8 contenders: FP8_CONTENDERS=a,b (bench/bench_lora.py --help lists them)}
    contenders=${CONTENDERS:-galaxy-lora-compiled,$fp8,unsloth-lora,unsloth-lora-sdpa}
    refuse_if_running "$dir" fp8
    enter_own_tree "$dir"
    rm -f "$dir"/fp8.*
    install_lora_deps "$deps" || exit 1
    lora_env "$deps"
    start_detached "$dir" fp8 "python3 bench/bench_lora.py --preset ${PRESET:-llama-1b} --seq ${SEQ:-1024} \
        --batch ${BATCH:-8} --steps ${STEPS:-20} --warmup ${WARMUP:-3} --contenders $contenders \
        --unsloth_path $deps/unsloth --json $dir/fp8.json > $dir/fp8.log 2>&1"
    echo "contenders: $contenders"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" fp8 "$polls"
collect_lora "$dir" fp8
