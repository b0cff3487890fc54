#!/bin/bash
# The real comparison (issue 14, build item 1) on nvidia-h200-x2: each scenario is ONE torchrun launch of
# bench/bench_train.py with every contender. A launch outlasts one `run` command (10 minutes), so it starts
# in its own process session (it runs on while the machine stays held) and later calls wait for it:
#   here:  bash bench/device/prepare_carry.sh /work/main harness
#   run kind nvidia-h200-x2, carry [".carry/harness"]:
#          cd .carry/harness && bash bench/device/train_2xh200.sh start stack4
#          cd .carry/harness && bash bench/device/train_2xh200.sh wait stack4      (again, at once, until "done")
#          cd .carry/harness && bash bench/device/train_2xh200.sh start llama7b ... wait llama7b
# Call `wait` right after the previous call returns: an idle machine goes back after 30 s, the launch with it.
# Each call copies the JSON (when done) and the log so far (one ROW line per finished contender) to $OUT.
# Every contender ('*'; bench_train's own default is the 7B comparison of bench/device/train_node.sh, which is
# the script for llama7b now). Expected device time: stack4 (global batch 4 since issue 31: 4 sequences per
# optimizer step) well over the 11 minutes of batch 1; llama7b at global batch 16 with every contender: far
# longer than one session's device time (use train_node.sh).
set -o pipefail
mode=${1:?start|wait}; scenario=${2:?stack4|llama7b}; polls=${3:-56}  # 10 s polls per call
nproc=${NPROC:-2}  # NPROC=1 with the smoke scenario checks this flow on one GPU
dir=/root/bench_train; mkdir -p "$dir"
case $scenario in
    stack4)  flags=(--warmup 2 --iters 10 --contenders '*') ;;
    # serial and galaxy-none: 6.7B fp32 masters + grads + AdamW are 108 GB before activations, more than
    # one H200 holds, so they would only report OOM; left out to save device time.
    llama7b) flags=(--warmup 2 --iters 6 --contenders '*' --skip 'serial-*,galaxy-none') ;;
    smoke)   flags=(--warmup 2 --iters 5 --contenders '*') ;;
    *) echo "unknown scenario $scenario (stack4 | llama7b | smoke)"; exit 2 ;;
esac
if [ "$mode" = start ]; then
    rm -f "$dir/$scenario.done"
    setsid bash -c "OUT=$dir bash bench/device/train_harness.sh $nproc $scenario ${flags[*]@Q}; touch $dir/$scenario.done" \
        > "$dir/$scenario.console" 2>&1 < /dev/null &
fi
for _ in $(seq 1 "$polls"); do  # up to ~9.5 minutes per call
    [ -e "$dir/$scenario.done" ] && break
    sleep 10
done
cp "$dir"/train_"$scenario"_"$nproc".* "$dir/$scenario.console" "${OUT:-/tmp}/" 2>/dev/null
grep -c '^ROW ' "$dir/train_${scenario}_${nproc}.log" 2>/dev/null | sed 's/^/rows so far: /'
if [ -e "$dir/$scenario.done" ]; then echo done; tail -45 "$dir/$scenario.console"; else echo "still running: call wait again"; fi
