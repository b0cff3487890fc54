#!/bin/bash
# PEFT on several GPUs (issue 32 item 5): bench/bench_peft_mp.py launches, started detached (setsid + nohup; logs,
# JSON and console under /root/bench_peft_mp) so that later `run` calls wait for them and collect them to $OUT.
# Nothing to carry: the bench needs torch, triton and this tree only (run from the repo root the tool sends).
#
# On nvidia-h100-x2 (part 7b) or nvidia-h100-x4 (part 70b):
#   bash bench/device/peft_mp.sh start 7b && bash bench/device/peft_mp.sh wait 7b
#   bash bench/device/peft_mp.sh wait 7b          # again, at once, until it prints "done"
#   bash bench/device/peft_mp.sh start 70b && bash bench/device/peft_mp.sh wait 70b
# `start` returns at once; each `wait` polls up to ~9 minutes (POLLS x 10 s) and copies the JSON of every
# finished launch, the logs so far (one ROW line per finished contender) and the console to $OUT; `collect` only
# copies. Call `wait` right after the previous call returns: an idle machine goes back soon, the launch with it.
#
# Parts (launches one after the other; each a torchrun of all its contenders; ONLY=<tag> runs one launch of the
# part, CONTENDERS=a,b replaces its contenders):
#   7b  (2 GPUs) LLaMA-7B shapes, seq 1024: the one-GPU rows (lora-none, qlora-none, and both +recompute) and
#       lora/qlora on tp, galaxy, galaxy2 at TP 2 -- at global batch 2 (bench_lora's 7B rows) and again at 1.
#   smoke (NPROC GPUs, default 2; or CPUs) the tiny scenario, every contender: the flow in a minute.
#   70b (4 GPUs) Llama-2-70B shapes (bf16 base 138 GB), seq 1024, global batch 1: lora-tp, lora-galaxy, qlora-tp
#       and qlora-none+recompute (the 70B's NF4 base on one GPU, rank 0 alone: last, an OOM there ends only its
#       row); then the 7B at TP 4 (lora/qlora none, tp, galaxy) at global batch 2.
# Expected wall time (an estimate, not measured): each launch ~30 s of start-up (imports, NCCL) and Triton's
# first compiles (~30 s, cached after); a 7B contender ~10-15 s (its base drawn on the GPU in ~1 s, NF4 quantized
# there; 3 + 10 steps of 0.1-0.25 s and one eager step); part 7b ~6 min. A 70B contender: ~20 s to build, steps of
# ~0.3-0.5 s at TP 4 (2 + 5 timed), qlora-none+recompute ~2 s a step on one GPU: ~1-2 min each; part 70b ~8 min.
set -o pipefail
mode=${1:?start|wait|collect}; part=${2:?7b|70b|smoke}; polls=${POLLS:-55}
dir=${PEFT_DIR:-/root/bench_peft_mp}; mkdir -p "$dir"
case $part in
    7b)  nproc=2
         launches=("llama7b llama7b_2_b2 --global_batch 2"
                   "llama7b llama7b_2_b1 --global_batch 1") ;;
    70b) nproc=4
         launches=("llama70b llama70b_4 --warmup 2 --iters 5 --contenders lora-tp,lora-galaxy,qlora-tp,qlora-none+recompute"
                   "llama7b llama7b_4_b2 --global_batch 2 --contenders lora-none,qlora-none,lora-tp,qlora-tp,lora-galaxy,qlora-galaxy") ;;
    # the flow itself, in seconds: tiny shapes, every contender (on a CPU host too: Gloo)
    smoke) nproc=${NPROC:-2}
         launches=("smoke smoke_$nproc --warmup 1 --iters 2 --contenders '*'") ;;
    *) echo "unknown part $part (7b | 70b | smoke)"; exit 2 ;;
esac
if [ "$mode" = start ]; then
    if [ -e "$dir/$part.pid" ] && kill -0 "$(cat "$dir/$part.pid")" 2>/dev/null; then
        echo "already running: $part (pid $(cat "$dir/$part.pid")); call wait"; exit 1
    fi
    rm -f "$dir/$part.done" "$dir/$part.console"
    script="export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1"
    script+=" PYTHONPATH=$PWD GALAXY_COMMIT=${GALAXY_COMMIT:-$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)};"
    script+=" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;"
    for spec in "${launches[@]}"; do
        read -r scenario tag flags <<< "$spec"
        [ -n "${ONLY:-}" ] && [ "$tag" != "$ONLY" ] && continue  # ONLY=<tag>: that launch of the part alone
        [ -n "${CONTENDERS:-}" ] && flags+=" --contenders $CONTENDERS"  # the last --contenders counts
        rm -f "$dir/$tag.json" "$dir/$tag.log"
        script+=" echo \"== $tag: \$(date +%T)\";"
        script+=" torchrun --standalone --nproc_per_node $nproc bench/bench_peft_mp.py --scenario $scenario $flags"
        script+=" --json $dir/$tag.json 2>&1 | tee $dir/$tag.log | grep -v '^ROW ';"
    done
    script+=" echo \"== end: \$(date +%T)\"; touch $dir/$part.done"
    setsid nohup bash -c "$script" > "$dir/$part.console" 2>&1 < /dev/null &
    echo $! > "$dir/$part.pid"
    echo "started $part (pid $!): ${#launches[@]} launches on $nproc GPUs"
    exit 0
fi
if [ "$mode" = wait ]; then
    for _ in $(seq 1 "$polls"); do
        [ -e "$dir/$part.done" ] && break
        sleep 10
    done
fi
for spec in "${launches[@]}"; do
    read -r _ tag _ <<< "$spec"
    cp "$dir/$tag".json "$dir/$tag".log "${OUT:-/tmp}/" 2>/dev/null
    rows=$(grep -c '^ROW ' "$dir/$tag.log" 2>/dev/null); echo "$tag: ${rows:-0} rows so far"
done
cp "$dir/$part.console" "${OUT:-/tmp}/" 2>/dev/null
if [ -e "$dir/$part.done" ]; then echo done; tail -40 "$dir/$part.console"; else echo "still running: call wait again"; tail -5 "$dir/$part.console"; fi
