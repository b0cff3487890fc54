#!/bin/bash
# GPU round 7 (one H200; issues 50 and 51), one detached launch of three parts back to back, so the card never
# idles between them (a session has 30 minutes of device time):
#   fp8    the fp8 LoRA table: bench_lora's fp8-base rows beside Galaxy's compiled bf16 LoRA and unsloth's LoRA
#          (both attention paths), Llama-3.2-1B shapes, 1024 x 8, r16 on q/v, 20 timed steps after 3; with two
#          MLPs recomputed (+mlp2: ~512 MiB, what issue 51's 0.8x memory line needs) and under CUDA graphs (the
#          profiled fp8 step idles 16.7 ms)
#   long   LoRA and QLoRA at 32,768 tokens, batch 1: Galaxy's compiled rows with activation_memory auto within the
#          card (+auto) and within a budget under unsloth's measured peak (+auto<G>), beside unsloth's offloaded
#          checkpointing (-gc) on both attention paths; 3 timed steps after 1
#   f8t    full training in float8 (torchao) against bf16: bench_train's stack4 (LLaMA-7B shapes, 4 layers, 4 x 4096
#          tokens a step) on one GPU, Galaxy's compiled model beside the fsdp2-compile anchor (torchtitan's order:
#          convert_to_float8_training, compile, fully_shard), --float8 none | tensorwise | rowwise
# Round 8 adds:
#   long8  part long's rows with budgets LORA_GIB / QLORA_GIB (default 5.3 / 4.0) under unsloth's 32k peaks
#          (5,849 / 4,504 MiB in round 7), the SDPA rows of unsloth only (the faster at 32k in every launch)
#   max    --max_seq on a card capped at MAX_CARD_GIB (default 8) for every contender, every one with unsloth's
#          allocator setting (expandable segments; round 8 gave it to unsloth only): Galaxy's compiled LoRA +auto
#          against unsloth's offloaded checkpointing (SDPA), from 16,384 tokens (MAX_CONTENDERS: others, e.g.
#          galaxy-qlora-compiled+auto,unsloth-qlora-gc-sdpa; MAX_START, default 16,384)
#   prof   part fp8's Galaxy rows (fp8 compiled and under CUDA graphs, bf16) and unsloth's xformers row again, each
#          profiled (kernel tables and the step's GPU time by category in the JSON)
#   f8prof part f8t's Galaxy rows for none and tensorwise, each with one profiled step
#   fp8b   part fp8 at seq 4,096 x batch 2
# Round 10: part fp8 recomputes two and three MLPs (round 9's +mlp2 took nothing off under torch 2.11: a plain
# checkpoint in a compiled layer left the fp8 linear's ops unmarked, fixed in a07a3f4), with and without CUDA graphs
# Round 11 adds:
#   qlmem  where the QLoRA +auto plan's memory goes at 65,536 and 98,304 tokens within 8 GiB (round 10: 98,304 ran out of
#          memory for QLoRA where LoRA's plan fit): bench/long_context_memory.py's probe, plan, prediction and
#          measured peak, NF4 and bf16 bases, the card uncapped, a memory snapshot each (the JSON: what is alive at its peak, by site)
#   long8b Llama-3.1-8B shapes at 32,768 tokens: Galaxy's LoRA +auto within LONG8B_GIB (default 21.0: unsloth's
#          21,756 MiB of round 10 less 150) beside unsloth's offloaded checkpointing (SDPA)
# Round 12 adds:
#   fp8k   the graphed fp8 row profiled under two inductor settings that retune its reductions (round 11: the
#          row-wise quantizations fused after SwiGLU and its backward take 2.3x their bf16 kernels):
#          coordinate-descent tuning, and multi-kernel (persistent and looped reductions both built, the faster
#          taken); exploration, Galaxy alone (the env reaches every contender of a launch)
#   qlmem8 part qlmem's NF4 98,304-token auto plan on a card capped at 8 GiB (expandable segments), a fresh process:
#          what is alive when it runs out of memory
# Round 13 adds:
#   spy    py-spy (carried as a wheel: wheels/py_spy-*.whl) over part fp8's graphed fp8 row, 150 timed steps, idle
#          samples kept: where the host's time goes in a step and how long it waits on the device (raw stacks)
#   long8b takes LONG8B_SEQ (default 32,768); FP8_CONTENDERS / FP8B_CONTENDERS narrow parts fp8 / fp8b
#   qlchunks the NF4 base at 65,536 tokens, every layer mlp+offload, the MLP in 2 and in 16 chunks (QLCHUNKS): whether
#          what a compiled layer's backward holds grows with its chunks (98k's OOM held 21 dequantized MLP weights)
# Round 14: part fp8 adds multi-kernel with two MLPs recomputed (the 1.3x line at the memory line); bench_lora's rows
# are timed by their span since round 14 (steps that go ahead: one interval moves time between neighbours)
# Round 15 adds:
#   fp8b   multi-kernel with two and three MLPs recomputed (issue 51's 0.8x memory line at 4,096 x 2)
#   fp8_7b issue 51's LLaMA-7B line: part fp8's best rows and unsloth's two attention paths at LLaMA-7B shapes,
#          1024 x 8, 10 timed steps after 3 (FP8_7B_CONTENDERS narrows it)
# Round 16 adds:
#   f8full issue 51's full-depth float8 line: LLaMA-7B (32 layers, 16 x 4096 tokens a step) does not train on one
#          GPU, so rank 0 of a 4-GPU launch over torch's fake process group (bench_train --fake_world 4: the rank's
#          memory and compute, no communication), Galaxy's pick (plan none, dp 4 on FSDP2, 4 rows a micro-batch),
#          --float8 none | tensorwise (F8FULL_RECIPES)
#   f8curve issue 51's quality line at LLaMA-7B shapes on the GPU: bench/fp8_quality.py pretrains the 7B's first 4
#          layers (compiled, 2 x 4,096 tokens a step, 1,000 steps, vocabulary 32,000) in bf16 and in float8 tensorwise
#          (F8CURVE_VARIANTS), one after the other: ~6 min. The text: the sources of the standard library and of the
#          installed packages (F8CURVE_SOURCES): the standard library alone (2.3 M tokens) ran 3.6 times through in
#          round 17, where the training loss measures memorization
#   f8cli  the same setting as f8curve's runs in bench_train (stack4, 2 x 4,096 tokens a step, 2 rows a micro-batch,
#          vocabulary 32,000, --float8 none | tensorwise): round 17's CLI steps took 65 ms a row at a vocabulary of
#          27,315 where bench_train's took 45-48 at 32,000; with f8curve on the larger text (vocabulary 32,000) the two
#          say whether the CLI or the odd vocabulary costs it
#   prof4k the missed 2 x 4096 line's profile (issue 51): the graphed multi-kernel fp8 row (+mlp2) and unsloth's SDPA
#          row, 10 timed steps after 3, each profiled (kernel tables, GPU time by category in the JSON)
# Carry: the lora set and torchao (installed beside bitsandbytes and liger-kernel on every contender's path):
#   WHEELS=unsloth bash bench/device/prepare_carry.sh /work/main r7 && \
#     python3 bench/device/slim_wheel.py /work/main/.whl/torchao-*.whl /work/main/.carry/r7/wheels
# On nvidia-h200, carry [".carry/r7"]:
#   cd .carry/r7 && bash bench/device/round7.sh start && bash bench/device/round7.sh wait
#   cd .carry/r7 && bash bench/device/round7.sh wait     # again, at once, until it prints "done"
# PARTS="fp8 long f8t" (the default) picks and orders the parts; LONG_UNSLOTH_LORA / LONG_UNSLOTH_QLORA narrow the
# unsloth rows of part long (e.g. to the SDPA path, where a launch measured it the faster at 32k). Each wait packs
# the JSON so far, the logs, the clocks and the kernel tables into $OUT/round.tgz.
set -o pipefail
source "$(dirname "$0")/detached.sh"
source "$(dirname "$0")/lora_deps.sh"
mode=${1:?start|wait}; polls=${POLLS:-55}  # 10 s polls
dir=/root/round7; deps=$dir/deps; mkdir -p "$dir"
if [ "$mode" = start ]; then
    refuse_if_running "$dir" r7
    enter_own_tree "$dir"
    rm -f "$dir"/r7.* "$dir"/*.json "$dir"/*.log
    install_lora_deps "$deps" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$deps/common" wheels/torchao-*.whl || exit 1
    lora_env "$deps"
    lora="python3 bench/bench_lora.py --preset llama-1b --unsloth_path $deps/unsloth"
    train="python3 bench/bench_train.py --scenario stack4 --world 1 --contenders galaxy-tp+compile,fsdp2-compile \
--iters 8 --warmup 2"
    cmd=""
    for part in ${PARTS:-fp8 long f8t}; do
        case $part in
            fp8) cmd="$cmd $lora --seq 1024 --batch 8 --steps 20 --warmup 3 --contenders ${FP8_CONTENDERS:-galaxy-lora-compiled,\
galaxy-lora-fp8-compiled,galaxy-lora-fp8-compiled+mlp2,galaxy-lora-fp8-compiled+mlp3,galaxy-lora-fp8-cudagraphs,\
galaxy-lora-fp8-cudagraphs+mlp2,galaxy-lora-fp8-cudagraphs-multikernel,galaxy-lora-fp8-cudagraphs-multikernel+mlp2,unsloth-lora,\
unsloth-lora-sdpa} --json $dir/fp8_lora.json > $dir/fp8_lora.log 2>&1;" ;;
            long) cmd="$cmd $lora --seq 32768 --batch 1 --steps 3 --warmup 1 --contenders galaxy-lora-compiled+auto,\
galaxy-lora-compiled+auto5.5,${LONG_UNSLOTH_LORA:-unsloth-lora-gc,unsloth-lora-gc-sdpa},galaxy-qlora-compiled+auto,\
galaxy-qlora-compiled+auto4.2,\
${LONG_UNSLOTH_QLORA:-unsloth-qlora-gc,unsloth-qlora-gc-sdpa} --json $dir/long32k.json > $dir/long32k.log 2>&1;" ;;
            f8t) for f in none tensorwise rowwise; do
                     cmd="$cmd $train --float8 $f --json $dir/float8_$f.json > $dir/float8_$f.log 2>&1;"
                 done ;;
            long8) cmd="$cmd $lora --seq 32768 --batch 1 --steps 3 --warmup 1 --contenders \
galaxy-lora-compiled+auto${LORA_GIB:-5.3},unsloth-lora-gc-sdpa,galaxy-qlora-compiled+auto${QLORA_GIB:-4.0},\
unsloth-qlora-gc-sdpa --json $dir/long32k_budget.json > $dir/long32k_budget.log 2>&1;" ;;
            max) cmd="$cmd $lora --batch 1 --max_seq --card_gib ${MAX_CARD_GIB:-8} --max_seq_start ${MAX_START:-16384} \
--alloc_conf expandable_segments:True \
--contenders ${MAX_CONTENDERS:-galaxy-lora-compiled+auto,unsloth-lora-gc-sdpa} --json $dir/max_seq.json > $dir/max_seq.log 2>&1;" ;;
            prof) mkdir -p "$dir/prof"
                  cmd="$cmd $lora --seq 1024 --batch 8 --steps 10 --warmup 3 --profile $dir/prof --contenders \
galaxy-lora-fp8-compiled,galaxy-lora-fp8-cudagraphs,galaxy-lora-compiled,unsloth-lora --json $dir/fp8_prof.json > $dir/fp8_prof.log 2>&1;" ;;
            f8prof) mkdir -p "$dir/f8prof"
                    for f in none tensorwise; do
                        cmd="$cmd ${train/,fsdp2-compile/} --float8 $f --profile $dir/f8prof --json $dir/f8prof_$f.json \
> $dir/f8prof_$f.log 2>&1;"
                    done ;;
            fp8b) cmd="$cmd $lora --seq 4096 --batch 2 --steps 20 --warmup 3 --contenders ${FP8B_CONTENDERS:-galaxy-lora-compiled,\
galaxy-lora-fp8-compiled,galaxy-lora-fp8-cudagraphs,galaxy-lora-fp8-cudagraphs-multikernel,\
galaxy-lora-fp8-cudagraphs-multikernel+mlp2,galaxy-lora-fp8-cudagraphs-multikernel+mlp3,unsloth-lora,unsloth-lora-sdpa} \
--json $dir/fp8_4096.json > $dir/fp8_4096.log 2>&1;" ;;
            fp8_7b) cmd="$cmd ${lora/llama-1b/llama-7b} --seq 1024 --batch 8 --steps 10 --warmup 3 --contenders \
${FP8_7B_CONTENDERS:-galaxy-lora-compiled,galaxy-lora-fp8-cudagraphs-multikernel,galaxy-lora-fp8-cudagraphs-multikernel+mlp2,\
unsloth-lora,unsloth-lora-sdpa} --json $dir/fp8_7b.json > $dir/fp8_7b.log 2>&1;" ;;
            f8full) for f in ${F8FULL_RECIPES:-none tensorwise}; do
                        cmd="$cmd python3 bench/bench_train.py --scenario llama7b --global_batch 16 --micro_batch 4 \
--fake_world 4 --contenders ${F8FULL_CONTENDERS:-galaxy-tp+compile@dp4-fsdp2} --iters 6 --warmup 2 --float8 $f \
--json $dir/f8full_$f.json > $dir/f8full_$f.log 2>&1;"
                    done ;;
            f8curve) text=$(python3 -c 'import sysconfig; p = sysconfig.get_paths(); print(p["stdlib"], p["purelib"])')
                     cmd="$cmd python3 bench/fp8_quality.py --parts pretrain --sequential --recursive \
--sources ${F8CURVE_SOURCES:-$text} \
--variants ${F8CURVE_VARIANTS:-bf16,fp8-tensorwise} --steps ${F8CURVE_STEPS:-1000} --eval_every 100 --work_dir $dir/f8curve \
--override preset=llama-7b --override num_hidden_layers=4 --override vocab_size=32000 --override seq_length=4096 \
--override max_position_embeddings=4096 --override global_batch_size=2 --override compile=true --override lr=3e-4 --override warmup_steps=100 \
--out $dir/f8curve.json > $dir/f8curve.log 2>&1;" ;;
            f8cli) for f in none tensorwise; do
                       cmd="$cmd ${train/,fsdp2-compile/} --global_batch 2 --micro_batch 2 --float8 $f \
--json $dir/f8cli_$f.json > $dir/f8cli_$f.log 2>&1;"
                   done ;;
            prof4k) mkdir -p "$dir/prof"
                    cmd="$cmd $lora --seq 4096 --batch 2 --steps 10 --warmup 3 --profile $dir/prof --contenders \
galaxy-lora-fp8-cudagraphs-multikernel+mlp2,unsloth-lora-sdpa --json $dir/prof_4096.json > $dir/prof_4096.log 2>&1;" ;;
            qlmem) for q in nf4 none; do
                       cmd="$cmd python3 bench/long_context_memory.py --preset llama-1b --quantize $q --seqs 65536 98304 \
--budget_gib 8 --measure --modes auto --memory_history $dir/qlmem_$q --json $dir/qlmem_$q.json > $dir/qlmem_$q.log 2>&1;"
                   done ;;
            long8b) cmd="$cmd ${lora/llama-1b/llama-8b} --seq ${LONG8B_SEQ:-32768} --batch 1 --steps 3 --warmup 1 --contenders \
galaxy-lora-compiled+auto${LONG8B_GIB:-21.0},unsloth-lora-gc-sdpa --json $dir/long8b_${LONG8B_SEQ:-32768}.json \
> $dir/long8b_${LONG8B_SEQ:-32768}.log 2>&1;" ;;
            qlchunks) for c in ${QLCHUNKS:-2 16}; do
                          cmd="$cmd PYTORCH_ALLOC_CONF=expandable_segments:True python3 bench/long_context_memory.py \
--preset llama-1b --quantize nf4 --seqs 65536 --budget_gib 8 --measure --modes mlp+offload --mlp_chunks $c \
--memory_history $dir/qlchunks_$c --json $dir/qlchunks_$c.json > $dir/qlchunks_$c.log 2>&1;"
                      done ;;
            spy) python3 -m pip install -q --no-index --no-deps --target "$deps/spy" wheels/py_spy-*.whl || exit 1
                 cmd="$cmd $deps/spy/bin/py-spy record --idle --subprocesses --rate 250 --format raw \
--output $dir/spy_fp8.txt -- $lora --seq 1024 --batch 8 --steps 150 --warmup 3 --contenders galaxy-lora-fp8-cudagraphs \
--json $dir/spy_fp8.json > $dir/spy_fp8.log 2>&1;" ;;
            fp8k) mkdir -p "$dir/prof"
                  for knob in COORDINATE_DESCENT_TUNING MULTI_KERNEL; do
                      cmd="$cmd TORCHINDUCTOR_$knob=1 $lora --seq 1024 --batch 8 --steps 10 --warmup 3 --profile $dir/prof \
--contenders galaxy-lora-fp8-cudagraphs --json $dir/fp8k_$knob.json > $dir/fp8k_$knob.log 2>&1;"
                  done ;;
            qlmem8) cmd="$cmd PYTORCH_ALLOC_CONF=expandable_segments:True python3 bench/long_context_memory.py \
--preset llama-1b --quantize nf4 --seqs ${QLMEM8_SEQS:-98304} --budget_gib 8 --card_gib 8 --measure --modes auto \
--memory_history $dir/qlmem8 --json $dir/qlmem8.json > $dir/qlmem8.log 2>&1;" ;;
            *) echo "unknown part $part (fp8 | long | f8t | long8 | max | prof | f8prof | fp8b | qlmem | long8b | fp8k | qlmem8 | spy | qlchunks | fp8_7b | f8full | f8curve | f8cli | prof4k)"; exit 2 ;;
        esac
    done
    start_detached "$dir" r7 "$cmd"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" r7 "$polls"
# one archive: a call brings back only so many files
tar czf "${OUT:-/tmp}/round.tgz" -C "$dir" $(cd "$dir" && ls *.json *.log *.txt r7.console clocks_r7.csv 2>/dev/null) \
    $(cd "$dir" && ls -d prof 2>/dev/null) 2>/dev/null
for f in "$dir"/*.log; do echo "== $(basename "$f")"; grep -v '^ROW\|Warn' "$f" | tail -${TAIL:-8}; done
[ -e "$dir/r7.done" ] && echo done || echo "still running: call wait again"
