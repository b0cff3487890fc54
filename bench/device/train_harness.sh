#!/bin/bash
# bench/bench_train.py on the GPU machine: every contender of one scenario in one torchrun launch.
#   bash bench/device/train_harness.sh NPROC SCENARIO [extra bench_train.py flags...]
# Run from the root of a carried worktree whose wheels/ holds the anchors' wheels (see docs/benchmarks-log.md,
# "Full-cost training steps"). Writes $OUT/train_<scenario>_<nproc>[_<TAG>].json and .log (TAG: optional env,
# e.g. the part of a split launch).
set -o pipefail
nproc=${1:?NPROC}; scenario=${2:?SCENARIO}; shift 2
out=${OUT:-bench_out}; mkdir -p "$out"
name=train_${scenario}_${nproc}${TAG:+_$TAG}
# NVLink multicast stays off on these machines (KINDS.md); set here too for every process torchrun starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 GALAXY_COMMIT=${GALAXY_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
if ls wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        wheels/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
torchrun --standalone --nproc_per_node "$nproc" bench/bench_train.py --scenario "$scenario" \
    --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.log" \
    | grep -v '^ROW '
