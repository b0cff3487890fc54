#!/bin/bash
# bench/bench_lora.py with every contender, unsloth's included, in one launch on one GPU (issue 32 item 1),
# started detached (setsid + nohup; log, console and JSON under /root/bench_lora) so that later `run` calls
# wait for it and collect it.
#
# Here (not on the GPU machine; it has no pip index), cp312 manylinux x86_64 wheels into /work/main/.whl:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d /work/main/.whl \
#       unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
#       xformers==0.0.35 nvidia-cuda-runtime-cu12==12.9.79 peft==0.21.2 transformers==5.17.0 \
#       bitsandbytes==0.50.2 liger-kernel==0.8.5     (add --platform manylinux_2_17_x86_64 for the CUDA runtime)
#   WHEELS=unsloth bash bench/device/prepare_carry.sh /work/main lora     # -> /work/main/.carry/lora
# What each is for (the GPU image has torch 2.11, triton, accelerate, peft, transformers 5.17.0 as last read,
# huggingface_hub, tokenizers, safetensors, sentencepiece, torchvision, pandas, pyarrow, xxhash, fsspec, httpx):
#   unsloth, unsloth_zoo     the contender (unsloth slimmed by slim_wheel.py: without its web UI, 1.8 MiB)
#   trl, datasets, dill, multiprocess    imported by `import unsloth` (checked: it fails without each)
#   xformers 0.0.35          unsloth's dense attention when there is no flash-attn (else it falls back to SDPA;
#                            the row's `attention` says which ran). PyPI's build is for torch 2.10 + CUDA 12.8 and
#                            links libcudart.so.12, which the CUDA 13 image lacks: nvidia-cuda-runtime-cu12 (only
#                            that library) goes to $deps/cu12, on LD_LIBRARY_PATH only (no Python path); where
#                            xformers still cannot load, unsloth says so and runs SDPA, and -sdpa contenders
#                            (xformers hidden) measure SDPA on purpose
#   bitsandbytes 0.50.2      NF4 for unsloth-qlora and peft-qlora-bnb (slimmed to its CUDA 13 and CPU libraries)
#   liger_kernel 0.8.5       peft-bf16-liger
#   peft 0.21.2, transformers 5.17.0    installed for unsloth only where the image's fail unsloth's
#                            requirements (peft>=0.18, transformers<=5.17.0 minus some); the check prints why
# Left out, declared by unsloth but not needed to import it or train a LoRA / QLoRA on a dense model: torchao,
# cut_cross_entropy (off for torch>=2.8 in unsloth_zoo), diffusers, tyro, msgspec, hf_transfer, pydantic,
# structlog, json5, nest-asyncio, typer extras (checked: `import unsloth` with none of them installed).
#
# Carry size (2026-11-27): 31 MiB of wheels (unsloth 1.8 and bitsandbytes 6.8 after slimming) + this tree.
# On nvidia-h100-x1 (or any one-GPU kind), carry [".carry/lora"]:
#   cd .carry/lora && bash bench/device/lora_unsloth.sh start && bash bench/device/lora_unsloth.sh wait
#   cd .carry/lora && bash bench/device/lora_unsloth.sh wait      # again, at once, until it prints "done"
# `start` installs the wheels into /root/bench_lora/deps (common: bitsandbytes, liger-kernel, on every
# contender's path; unsloth: the rest, first on the unsloth contenders' path only, through --unsloth_path),
# prints which versions it found, then launches. Each call copies the JSON (when done), the log so far and the
# console to $OUT. CONTENDERS=a,b (default: bench_lora's eight + unsloth-lora-gc and unsloth-qlora-gc, its
# recommended checkpointing), STEPS / WARMUP and PRESET / SEQ / BATCH (llama-1b, 1024, 8 unless given) change
# the launch; if xformers breaks unsloth's rows, run
# CONTENDERS=unsloth-lora-sdpa,unsloth-qlora-sdpa,unsloth-lora-gc-sdpa,unsloth-qlora-gc-sdpa.
# Expected wall time (an estimate, not measured yet): ~1 min per Galaxy or peft contender, ~2 min per unsloth
# contender (its import, a random 1B reloaded from the launch's one saved copy, its compiled loss): ~18 min for the
# default sixteen, start + two waits; CONTENDERS narrows it.
set -o pipefail
source "$(dirname "$0")/detached.sh"
source "$(dirname "$0")/lora_deps.sh"
mode=${1:?start|wait|collect}; polls=${POLLS:-50}  # 10 s polls
dir=/root/bench_lora; deps=$dir/deps; mkdir -p "$dir"
contenders=${CONTENDERS:-galaxy-lora,galaxy-lora-compiled,galaxy-qlora,peft-bf16,peft-bf16-liger,peft-qlora-bnb}
# unsloth with both attention paths (xformers, SDPA): its faster row is its family's anchor in the report's summary
contenders=${CONTENDERS:-$contenders,unsloth-lora,unsloth-lora-sdpa,unsloth-qlora,unsloth-qlora-sdpa,unsloth-lora-gc,unsloth-qlora-gc}
if [ "$mode" = start ]; then
    refuse_if_running "$dir" lora
    enter_own_tree "$dir"
    rm -f "$dir"/lora.*
    install_lora_deps "$deps" || exit 1
    profile=; floor=
    [ -n "$PROFILE" ] && profile="--profile $dir/prof" && mkdir -p "$dir/prof"
    preset=${PRESET:-llama-1b}; seq=${SEQ:-1024}; batch=${BATCH:-8}
    [ -n "$FLOOR" ] && floor="python3 bench/compute_floor.py --preset $preset --seq $seq --micro_batch $batch \
        --global_batch $batch --gpus 1 --mp 1 --lora_rank 16 --json $dir/lora.floor.json > $dir/lora.floor.log 2>&1;"
    lora_env "$deps"
    start_detached "$dir" lora "$floor python3 bench/bench_lora.py --preset $preset --seq $seq --batch $batch \
        --steps ${STEPS:-10} --warmup ${WARMUP:-3} --contenders $contenders --unsloth_path $deps/unsloth \
        $profile --json $dir/lora.json > $dir/lora.log 2>&1"
    echo "contenders: $contenders"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" lora "$polls"  # up to ~8 minutes per call
[ -d "$dir/prof" ] && tar czf "${OUT:-/tmp}/lora_profile.tgz" -C "$dir" prof
collect_lora "$dir" lora
