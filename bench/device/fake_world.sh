#!/bin/bash
# One GPU, a rank of a 2-GPU launch: the peak memory of issue 31's 2-GPU pick and of the best anchor, each at its
# rows per micro-batch (bench/bench_train.py --fake_world 2: rank 0 of 2 over torch's fake process group, whose
# collectives return at once; what the rank allocates is what it allocates in a real launch, its times leave the
# collectives out). LLaMA-7B, global batch 16 x 4096. Started detached (a 7B launch outlives one `run` call):
#   bash bench/device/fake_world.sh start && bash bench/device/fake_world.sh wait     # ~3 min
# `wait` waits up to POLLS x 10 s and copies the JSON, the log and the console to $OUT.
# The check of the method (docs/benchmarks.md, "Measured on one GPU as a rank of two"): the same two contenders
# in e1eb197's tree, with bb7f245's bench/bench_train.py change applied (`git diff bb7f245~1 bb7f245 --
# bench/bench_train.py`; one hunk, the report's facts, does not apply and is not needed), gave the peaks of that
# commit's real 2 x H200 launch to the byte; there a launch has one --micro_batch, so one process per contender.
set -o pipefail
source "$(dirname "$0")/detached.sh"
mode=${1:?start|wait|collect}; polls=${POLLS:-50}
dir=/root/fake_world; mkdir -p "$dir"
if [ "$mode" = start ]; then
    refuse_if_running "$dir" fake
    enter_own_tree "$dir"
    start_detached "$dir" fake "PYTHONPATH=. python3 bench/bench_train.py --scenario llama7b --fake_world 2 \
        --global_batch 16 --warmup 2 --iters 3 \
        --contenders 'galaxy-tp+compile@dp2-fsdp2:mb4,fsdp2-compile-noreshard-onesync:mb2' \
        --json $dir/fake.json > $dir/fake.log 2>&1"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" fake "$polls"
cp "$dir"/fake.* "$dir/clocks_fake.csv" "${OUT:-/tmp}/" 2>/dev/null
if [ -e "$dir/fake.done" ]; then echo done; tail -6 "$dir/fake.log"; else echo "still running: call wait again"; fi
