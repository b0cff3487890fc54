#!/bin/bash
# One GPU, a rank of a W-GPU launch (issue 51 item 1, the fair table): every FSDP2 anchor setting of bench_train
# (resharding after forward on and off, one gradient reduce-scatter per micro-batch or per step) at every rows per
# micro-batch (1, 2, 4; --sweep_rows: each point a launch of its own, out of memory a row), beside Galaxy's pick
# (plan none, dp W on FSDP2) swept alike; LLaMA-7B, global batch 16 x 4096. bench/bench_train.py --fake_world W
# plays rank 0 of W over torch's fake process group: what the rank allocates is what it allocates in a real launch
# (so which settings fit, and their peaks); its times leave the collectives out (compute alone: no throughput
# claim). Started detached (a sweep outlives one `run` call):
#   WORLD=4 PART=reshard bash bench/device/fake_world.sh start && bash bench/device/fake_world.sh wait
#   bash bench/device/fake_world.sh wait      # again, at once, until it prints "done" (WORLD / PART as at start)
# PART: reshard (fsdp2-compile, fsdp2-compile-onesync and the pick: 9 points), noreshard (fsdp2-compile-noreshard,
# fsdp2-compile-noreshard-onesync: 6 points), all (15); long32k / long128k: the long-sequence scenarios (LLaMA-8B
# shapes, 131,072 tokens a step, every contender recomputing whole layers) at WORLD=4: FSDP2 (32k: dp 4) or FSDP2
# with torch's context_parallel (128k: cp 4, the run that exercises context_parallel on a GPU) beside Galaxy's
# model on FSDP2 (32k) or its sequence-sharded plan with the replicated weights sharded over mp (128k: sp, fsdp),
# one launch, ~3 min a contender (~13 s a 128k step): ~6 min. Fake collectives fill their outputs with whatever
# memory held: a plan that gathers activations (sp) may stop on a non-finite loss, as Galaxy2 at TP 2 did; its
# real peak then needs real GPUs. The anchor checks no loss and runs.
# A point is a fresh process: ~10 s to start, ~10 s to build
# the 7B, 20-40 s to compile its blocks (inductor's on-disk cache serves the points of the same rows), 3 steps
# (2 warm-up) and one eager step. Expected wall time (an estimate, not measured): ~55 s a point at WORLD=4
# (4 rows a rank a step), ~70 s at WORLD=2 (8 rows): reshard ~8 min, noreshard ~6 min at WORLD=4.
# The check of the method (docs/benchmarks-log.md, "Measured on one GPU as a rank of two"): e1eb197's tree run this
# way gave the peaks of its real 2 x H200 launch to the byte (the script of that run: git show
# cc79385:bench/device/fake_world.sh).
set -o pipefail
source "$(dirname "$0")/detached.sh"
mode=${1:?start|wait|collect}; polls=${POLLS:-50}
world=${WORLD:-4}; part=${PART:-reshard}; scenario=
dir=/root/fake_world; mkdir -p "$dir"
case $part in
    reshard)   contenders="fsdp2-compile,fsdp2-compile-onesync,galaxy-tp+compile@dp$world-fsdp2" ;;
    noreshard) contenders="fsdp2-compile-noreshard,fsdp2-compile-noreshard-onesync" ;;
    all)       contenders="fsdp2-compile,fsdp2-compile-onesync,fsdp2-compile-noreshard,fsdp2-compile-noreshard-onesync,galaxy-tp+compile@dp$world-fsdp2" ;;
    long32k)   contenders="fsdp2-compile,galaxy-tp+compile@dp$world-fsdp2"; scenario=llama8b-32k ;;
    long128k)  contenders="fsdp2-cp@cp$world,galaxy-sp-fsdp+compile"; scenario=llama8b-128k ;;
    *) echo "unknown PART $part (reshard | noreshard | all | long32k | long128k)"; exit 2 ;;
esac
tag=fake${world}_$part
if [ "$mode" = start ]; then
    refuse_if_running "$dir" "$tag"
    enter_own_tree "$dir"
    if [ -n "$scenario" ]; then  # one launch: a rank of these holds one micro-batch of its one sequence (share)
        how="--scenario $scenario"
    else
        how="--scenario llama7b --global_batch 16 --sweep_rows ${ROWS:-1,2,4} --sweep_timeout_s 300"
    fi
    start_detached "$dir" "$tag" "PYTHONPATH=. python3 bench/bench_train.py $how --fake_world $world --warmup 2 \
        --iters 1 --contenders '${CONTENDERS:-$contenders}' --json $dir/$tag.json > $dir/$tag.log 2>&1"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" "$tag" "$polls"
cp "$dir/$tag".* "$dir/clocks_$tag.csv" "${OUT:-/tmp}/" 2>/dev/null
grep -c '^ROW ' "$dir/$tag.log" 2>/dev/null | sed 's/^/points so far: /'
if [ -e "$dir/$tag.done" ]; then echo done; tail -12 "$dir/$tag.log"; else echo "still running: call wait again"; fi
