#!/bin/bash
# The 7B comparison of issue 31 on one node: bench/bench_train.py --scenario llama7b --global_batch 16 (seq 4096:
# 65,536 tokens per optimizer step for every contender) on N GPUs, started detached (setsid + nohup, log and JSON
# under /root/bench_train_node) so that later `run` calls wait for it and collect it.
#
# Carry megatron-core as a wheel (here, not on the GPU machine; the GPU machine has no pip index). The GPU
# machine's python is 3.12 (cp312, manylinux x86_64); megatron-core 0.19.2 needs only torch, numpy and
# packaging, which the image has. Checked to resolve (2026-11-27):
#   megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#       pip download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
#           --platform manylinux_2_28_x86_64 -d /work/main/.whl megatron-core==0.19.2
#       WHEELS="megatron_core-0.19.2" bash bench/device/prepare_carry.sh /work/main node
# (prepare_carry.sh copies this worktree and those wheels into /work/main/.carry/node; without WHEELS it also
# carries torchtitan 0.3.0 and its imports, whose contender is not in this comparison. Wheels are never committed.)
#
# On nvidia-h100-x4 (N=4) or nvidia-h100-x2 (N=2), carry [".carry/node"]:
#   cd .carry/node && bash bench/device/train_node.sh start 4 a     # fsdp2-compile(-noreshard), fsdp2-tp, megatron-dp
#   cd .carry/node && bash bench/device/train_node.sh wait 4 a      # again, at once, until it prints "done"
#   cd .carry/node && bash bench/device/train_node.sh start 4 b     # Galaxy: galaxy-sharded, tp, galaxy2-sharded
#   cd .carry/node && bash bench/device/train_node.sh wait 4 b
# or PART all: one launch of all seven (bench_train's default contenders). `start` returns at once (add a wait
# in the same call: `... start 4 a && bash bench/device/train_node.sh wait 4 a`). Call `wait` right after the
# previous call returns: an idle machine goes back soon, the launch with it. Each call copies the JSON (when
# done), the log so far (one ROW line per finished contender) and the console to $OUT; `collect` only copies.
#
# Time: warmup 2 steps (the first compiles the block: ~1 min per compiled contender, less where inductor's cache
# already holds the graph, as for fsdp2-compile-noreshard after fsdp2-compile) + 3 timed steps + 1 eager step
# (bytes and tokens counted; Galaxy rows one more for their metrics) per contender, each step ~2 s at 4 GPUs
# (16 x 4096 tokens at ~40% MFU); Galaxy builds a 7B on the host (~50 s each). Expected wall time at 4 GPUs
# (an estimate, not measured yet): part a ~4 min, part b ~5-6 min. WARMUP=1 ITERS=3 saves ~15 s a part;
# MICRO_BATCH=4 runs 4 rows per micro-batch (default 1); MICRO_BATCH="1 4" runs the part once per value, one
# after the other in the launch (JSON train_llama7b_N_PART_mbR.*). clocks_<tag>.csv: every GPU's SM clock and
# power. PROBE=1 first runs bench/device/planner_probe.py on GPU 0 (a planner piece in bursts against 15 s back
# to back, probe_<tag>.json).
# At 2 GPUs the steps take twice as long: parts, not one launch.
set -o pipefail
source "$(dirname "$0")/detached.sh"
mode=${1:?start|wait|collect}; nproc=${2:?NPROC (2 or 4)}; part=${3:-all}; polls=${POLLS:-55}  # 10 s polls
dir=/root/bench_train_node; mkdir -p "$dir"
case $part in
    a)   contenders='fsdp2-compile,fsdp2-compile-noreshard,fsdp2-tp,megatron-dp' ;;
    b)   contenders='galaxy-galaxy-sharded+compile,galaxy-tp+compile,galaxy-galaxy+compile@dp2-fsdp2' ;;
    # Galaxy2 at TP 2 (issue 31 item 4): its replicated MLP sharded over mp (fsdp) against sharded (ZeRO-2 over mp)
    fit) contenders='galaxy-galaxy2-fsdp,galaxy-galaxy2-sharded+compile' ;;
    all) contenders='galaxy-galaxy-sharded+compile,galaxy-tp+compile,galaxy-galaxy+compile@dp2-fsdp2,fsdp2-compile,fsdp2-compile-noreshard,fsdp2-tp,megatron-dp' ;;
    # issue 31 item 5: the anchors and Galaxy's dp candidates (FSDP2 over dp 2 x galaxy mp 2, over dp 4 with
    # mp 1), each with and without resharding after forward; PROFILE=1 profiles one more step of each
    # (bench/step_profile.py) and FLOOR=1 first times the step's compute floor (bench/compute_floor.py)
    # (megatron-dp last: megatron-core's buffers outlive its contender and crowd the next ones)
    dp) contenders='fsdp2-compile,fsdp2-compile-noreshard,fsdp2-tp,galaxy-galaxy+compile@dp2-fsdp2,galaxy-galaxy+compile@dp2-fsdp2-noreshard,galaxy-tp+compile@dp4-fsdp2,galaxy-tp+compile@dp4-fsdp2-noreshard,megatron-dp' ;;
    # one gradient reduce-scatter per step (fsdp_grad_sync last_micro_batch; the anchor's set_requires_gradient_sync)
    # beside the best rows of part dp, again in this launch
    sync) contenders='fsdp2-compile-noreshard,fsdp2-compile-noreshard-onesync,galaxy-tp+compile@dp4-fsdp2-noreshard-onesync,galaxy-galaxy+compile@dp2-fsdp2' ;;
    # the 2-GPU scenario: the best anchor and Galaxy rows of the 4-GPU launches, and the anchor's default and the
    # fastest Galaxy plan at 2 GPUs before (mp 2, sharded); onesync keeps unsharded fp32 gradients: H200s only
    two) contenders='fsdp2-compile-noreshard-onesync,fsdp2-compile,galaxy-tp+compile@dp2-fsdp2-noreshard-onesync,galaxy-galaxy-sharded+compile' ;;
    # the same with every anchor of the Done-when (FSDP2 x TP, megatron-core with its distributed optimizer, last)
    twoall) contenders='galaxy-galaxy-sharded+compile,fsdp2-compile-noreshard-onesync,fsdp2-compile,fsdp2-tp,galaxy-tp+compile@dp2-fsdp2-noreshard-onesync,megatron-dp' ;;
    # the same, Galaxy's fastest row after the anchors (megatron-dp still last; bench_train keeps the order given
    # since efca89d; the launch at dbabd5c still ran Galaxy first), without the dp2 row
    twolast) contenders='fsdp2-compile-noreshard-onesync,fsdp2-compile,fsdp2-tp,galaxy-galaxy-sharded+compile,megatron-dp' ;;
    # the 2-GPU scenario after the one-row compile fix (3392d9c): every anchor, Galaxy's mp-2 plans (galaxy and
    # galaxy2, ZeRO-2 over mp) after them, megatron-dp last
    twofix) contenders='fsdp2-compile-noreshard-onesync,fsdp2-compile,fsdp2-tp,galaxy-galaxy-sharded+compile,galaxy-galaxy2-sharded+compile,megatron-dp' ;;
    # the 4-GPU scenario after the fix: every anchor, Galaxy's best dp4 row (its dp axis on FSDP2, the anchor's
    # engine), Galaxy2 over dp 2 x mp 2 and at mp 4 (ZeRO-2 over mp), megatron-dp last; MICRO_BATCH="1 2" (the
    # anchor is fastest at 2 rows on 2 GPUs)
    fourfix) contenders='fsdp2-compile-noreshard-onesync,fsdp2-compile,fsdp2-tp,galaxy-tp+compile@dp4-fsdp2-noreshard-onesync,galaxy-galaxy2+compile@dp2-fsdp2-noreshard-onesync,galaxy-galaxy2-sharded+compile,megatron-dp' ;;
    # the planner's rows question (issue 31 item 6): Galaxy's 2-GPU plan alone, run with MICRO_BATCH="1 4" PROFILE=1
    rows) contenders='galaxy-galaxy-sharded+compile' ;;
    # every anchor and the planner's pick, each at the rows per micro-batch it was fastest at (bench_train's
    # name:mb<R>), in one launch (issue 31's Done-when): the anchors at 2 rows (megatron-dp at 1: out of memory
    # at 2), the pick (plan none on dp-N FSDP2) at 4, Galaxy2 at mp 2 at 4 on 2 GPUs; megatron-dp last
    best) contenders="fsdp2-compile-noreshard-onesync:mb2,fsdp2-compile:mb2,fsdp2-tp:mb2,galaxy-tp+compile@dp$nproc-fsdp2:mb4"
        [ "$nproc" = 2 ] && contenders+=",galaxy-galaxy2-sharded+compile:mb4"
        contenders+=",megatron-dp:mb1" ;;
    *) echo "unknown part $part (a | b | fit | all | dp | sync | two | twoall | twolast | twofix | fourfix | rows | best)"; exit 2 ;;
esac
contenders=${CONTENDERS:-$contenders}  # CONTENDERS=a,b: some of a part's rows (its tag stays the part's)
tag=llama7b_${nproc}_${part}
micro_batches=(${MICRO_BATCH:-1})
flags=(--global_batch "${GLOBAL_BATCH:-16}" --warmup "${WARMUP:-2}" --iters "${ITERS:-3}" --contenders "$contenders")
# MEMORY_CAP_GIB=76: each GPU's allocator capped as on an 80 GB card (79.6 GiB, less the CUDA context and NCCL's
# buffers, which sit outside the cap), e.g. MEMORY_CAP_GIB=76 MICRO_BATCH="1 2" ... start 2 fit (issue 31 item 4)
[ -n "${MEMORY_CAP_GIB:-}" ] && flags+=(--memory_cap_gib "$MEMORY_CAP_GIB")
if [ "$mode" = start ]; then
    refuse_if_running "$dir" "$tag"
    enter_own_tree "$dir"
    rm -f "$dir"/train_"$tag"[._]*
    job=""
    [ -n "${FLOOR:-}" ] && job="PYTHONPATH=\$PWD python3 bench/compute_floor.py --gpus $nproc --json $dir/floor_$tag.json; "
    [ -n "${PROBE:-}" ] && job+="PYTHONPATH=\$PWD python3 bench/device/planner_probe.py --model llama-7b --layers 2 \
--rows 4 --sustain_s 15 --out $dir/probe_$tag.json; "
    for mb in "${micro_batches[@]}"; do
        run_tag=$part; [ ${#micro_batches[@]} -gt 1 ] && run_tag=${part}_mb$mb
        run_flags=("${flags[@]}" --micro_batch "$mb")
        [ -n "${PROFILE:-}" ] && run_flags+=(--profile "$dir/traces_$run_tag")
        job+="TAG=$run_tag OUT=$dir bash bench/device/train_harness.sh $nproc llama7b ${run_flags[*]@Q}; "
    done
    # THEN: a command to start when the launch is done (e.g. THEN="bash bench/device/planner_node.sh start node 4",
    # which detaches in turn: call its wait next), so that one call's wait covers both without an idle machine
    [ -n "${THEN:-}" ] && job+="$THEN; "
    start_detached "$dir" "$tag" "$job"
    echo "job: $job"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" "$tag" "$polls"  # up to ~9 minutes per call
cp "$dir"/train_"$tag"[._]* "$dir/$tag.console" "$dir"/{floor,probe}_"$tag".json "$dir/clocks_$tag.csv" "${OUT:-/tmp}/" 2>/dev/null
# rank 0's chrome traces of the profiled steps, when done (gzipped; the largest may not come back)
[ -e "$dir/$tag.done" ] && cp -r "$dir"/traces_"$part" "$dir"/traces_"$part"_mb* "${OUT:-/tmp}/" 2>/dev/null
cat "$dir"/train_"$tag"*.log 2>/dev/null | grep -c '^ROW ' | sed 's/^/rows so far: /'
if [ -e "$dir/$tag.done" ]; then echo done; tail -20 "$dir/$tag.console"; else echo "still running: call wait again"; fi
