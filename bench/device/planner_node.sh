#!/bin/bash
# The planner on a GPU node (issue 31 item 6), started detached (setsid + nohup; logs and JSON under
# /root/planner_node) so that later `run` calls wait for it and collect it. No wheels: run from the tree.
#   bash bench/device/planner_node.sh start probe     # one GPU: bench/device/planner_probe.py (a calibration step
#                                                     # under torch.profiler, pieces timed both ways), then a
#                                                     # one-GPU profile of the 7B (pieces, optimizer, calibration)
#   bash bench/device/planner_node.sh start node N    # N GPUs: profile the 7B on N, plan global batch 16 x 4096
#                                                     # (compiled: COMPILE=0 for eager), --validate ${VALIDATE:-3}
#   bash bench/device/planner_node.sh wait probe|node N   # again, at once, until it prints "done" (SOCKETS=1 on
#                                                     # both calls for the slow-link run)
# EXTRA: more --override KEY=VALUE for the profile and the plan; PLAN_EXTRA: flags of the plan alone, e.g.
# PLAN_EXTRA="--dp_engines fsdp2" (the search also runs dp on FSDP2); CLUSTER=FILE: no profile, plan from FILE
# Each call copies what exists so far to $OUT. Time (estimates): probe ~3 min; node at 4 GPUs: the profile
# ~3-4 min, then each validated plan ~2-3 min (a 7B built per rank, compiled, STEPS=5 steps of ~1.4-2.7 s:
# the median of the 4 after the first; at 3, of 2, and the 4-GPU pick of 2026-11-28 measured 5% above
# bench_train's time of the same configuration on the same GPUs).
set -o pipefail
source "$(dirname "$0")/detached.sh"
mode=${1:?start|wait|collect}; part=${2:?probe|node}; nproc=${3:-1}; polls=${POLLS:-55}  # 10 s polls
dir=/root/planner_node; mkdir -p "$dir"; tag=${part}_$nproc
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# SOCKETS=1: NCCL over sockets (no NVLink, no shared memory), a slow link, for the profile and every validated
# plan alike (their launches inherit this environment); its files are tagged _sockets
if [ -n "${SOCKETS:-}" ]; then export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1; tag=${tag}_sockets; fi
model="--model llama-7b --override dtype=bfloat16 --seq_length 4096 --global_batch_size 16 ${EXTRA:-}"  # EXTRA: more --override KEY=VALUE
compile=""; [ "${COMPILE:-1}" = 1 ] && compile="--override compile=true"
case $part in
    probe) job="python3 bench/device/planner_probe.py --model llama-7b --layers 2 --rows 4 --out $dir/probe.json; \
python3 plan_galaxy.py profile $model $compile --world 1 --rows 1 4 --reps 3 --calibration_layers 2 \
--out $dir/cluster_$tag.json --log_level INFO" ;;
    node) cluster=$dir/cluster_$tag.json
        job="python3 plan_galaxy.py profile $model $compile --world $nproc --rows 1 2 4 --reps 3 \
--calibration_layers 2 --out $cluster --log_level INFO && "
        # CLUSTER=FILE (a cluster file in the tree): plan and validate from it, no profile
        [ -n "${CLUSTER:-}" ] && cluster=$CLUSTER && job=""
        job+="python3 plan_galaxy.py $model $compile ${PLAN_EXTRA:-} --cluster $cluster --out $dir/plan_$tag.json --top 12 \
--validate ${VALIDATE:-3} --validate_steps ${STEPS:-5} --log_level INFO" ;;
    *) echo "unknown part $part (probe | node)"; exit 2 ;;
esac
if [ "$mode" = start ]; then
    refuse_if_running "$dir" "$tag"
    enter_own_tree "$dir"
    export PYTHONPATH=$PWD
    rm -f "$dir/$tag".* "$dir"/*_"$tag".json
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
    start_detached "$dir" "$tag" "$job"
    exit 0
fi
[ "$mode" = wait ] && wait_done "$dir" "$tag" "$polls"  # up to ~9 minutes per call
cp "$dir/$tag.console" "$dir/clocks_$tag.csv" "$dir"/*_"$tag".json "$dir"/*_"$tag".plans.json "$dir/probe.json" "${OUT:-/tmp}/" 2>/dev/null
if [ -e "$dir/$tag.done" ]; then echo done; tail -40 "$dir/$tag.console"; else echo "still running"; tail -5 "$dir/$tag.console"; fi
