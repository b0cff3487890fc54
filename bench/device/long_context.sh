#!/bin/bash
# Long-context LoRA and QLoRA on one H200 (issue 50 item 5): bench/bench_lora.py at batch 1, tokens/s at fixed long
# lengths and each contender's longest length (--max_seq: powers of two from a start, then one bisection step; a
# length counts when two whole training steps complete, each try a process of its own). Contenders: Galaxy's
# compiled LoRA and QLoRA with activation_memory auto and the card's memory as budget (+auto; GALAXY_MEMORY=full
# runs recompute: full instead, for a tree without activation_memory), unsloth's recommended offloaded
# checkpointing (-gc) with both its attention paths (xformers, SDPA). Carry and deps as lora_unsloth.sh (its header):
#   WHEELS=unsloth bash bench/device/prepare_carry.sh /work/main lora        # -> /work/main/.carry/lora
# On nvidia-h200, carry [".carry/lora"]:
#   cd .carry/lora && PART=1b bash bench/device/long_context.sh start && bash bench/device/long_context.sh wait
#   cd .carry/lora && bash bench/device/long_context.sh wait          # again, at once, until it prints "done"
# PART (each an estimate of its wall time on one H200, not measured: Galaxy ~45 s a 1B contender (build, compile,
# steps), ~2.5 min an 8B one; unsloth ~75 s a 1B contender (import, load, patch), ~2 min an 8B one):
#   1b            Llama-3.2-1B, 65,536 tokens (SEQS="32768 65536" for both lengths: ~13 min), 3 timed after 1: ~7 min
#   8b-lora       Llama-3.1-8B shapes (galaxy.config's llama-8b preset), 32,768 tokens, bf16 base: ~7 min
#   8b-qlora      the same over NF4 bases: ~7 min
#   1b-max-lora   Llama-3.2-1B --max_seq from 65,536 up to 131,072, bf16 base: 2-3 tries a contender, ~8 min
#   1b-max-qlora  the same over NF4 bases: ~8 min
#   8b-max-lora / 8b-max-qlora   LLaMA-8B --max_seq from 32,768 up to 131,072: ~2.5 min a try, ~20 min each (a
#                 lease of its own)
# The whole set does not fit one session's 30 minutes of device time: 1b, then 8b-lora and 8b-qlora, are the rows
# the docs' long-context table needs first. Each call copies the JSON (when done), the log so far (one line per
# contender, one per --max_seq try) and the console to $OUT.
set -o pipefail
source "$(dirname "$0")/detached.sh"
source "$(dirname "$0")/lora_deps.sh"
mode=${1:?start|wait|collect}; polls=${POLLS:-50}  # 10 s polls
dir=/root/long_context; deps=$dir/deps; mkdir -p "$dir"
part=${PART:-1b}; memory=${GALAXY_MEMORY:-auto}
lora="galaxy-lora-compiled+$memory,unsloth-lora-gc,unsloth-lora-gc-sdpa"
qlora="galaxy-qlora-compiled+$memory,unsloth-qlora-gc,unsloth-qlora-gc-sdpa"
case $part in
    1b)           preset=llama-1b; seqs=${SEQS:-65536}; contenders=$lora,$qlora ;;
    8b-lora)      preset=llama-8b; seqs=${SEQS:-32768}; contenders=$lora ;;
    8b-qlora)     preset=llama-8b; seqs=${SEQS:-32768}; contenders=$qlora ;;
    1b-max-lora)  preset=llama-1b; seqs=max; start_seq=65536; contenders=$lora ;;
    1b-max-qlora) preset=llama-1b; seqs=max; start_seq=65536; contenders=$qlora ;;
    8b-max-lora)  preset=llama-8b; seqs=max; start_seq=32768; contenders=$lora ;;
    8b-max-qlora) preset=llama-8b; seqs=max; start_seq=32768; contenders=$qlora ;;
    *) echo "unknown PART $part (1b | 8b-lora | 8b-qlora | 1b-max-lora | 1b-max-qlora | 8b-max-lora | 8b-max-qlora)"
       exit 2 ;;
esac
contenders=${CONTENDERS:-$contenders}
tag=long_${part}
if [ "$mode" = start ]; then
    refuse_if_running "$dir" "$tag"
    enter_own_tree "$dir"
    rm -f "$dir/$tag".*
    install_lora_deps "$deps" || exit 1
    lora_env "$deps"
    common="python3 bench/bench_lora.py --preset $preset --batch 1 --contenders $contenders --unsloth_path $deps/unsloth"
    if [ "$seqs" = max ]; then
        cmd="$common --max_seq --max_seq_start $start_seq --max_seq_limit ${LIMIT:-131072} --json $dir/$tag.json"
        cmd="$cmd > $dir/$tag.log 2>&1"
    else
        cmd=""
        for seq in $seqs; do  # one launch per length, one JSON each; the log holds them all
            cmd="$cmd $common --seq $seq --steps ${STEPS:-3} --warmup ${WARMUP:-1} --json $dir/$tag.$seq.json \
>> $dir/$tag.log 2>&1;"
        done
    fi
    start_detached "$dir" "$tag" "$cmd"
    echo "part $part: $preset at $seqs, contenders $contenders"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" "$tag" "$polls"
collect_lora "$dir" "$tag"
