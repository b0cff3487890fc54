#!/bin/bash
# Here (not on the GPU machine): copy this worktree and the harness's wheels into the main checkout's
# git-ignored .carry/<name>, for `run` with carry [".carry/<name>"].
#   bash bench/device/prepare_carry.sh /work/main harness
set -e
main=${1:?main checkout}; name=${2:?carry name}
here=$(cd "$(dirname "$0")/../.." && pwd)
dest="$main/.carry/$name"
rm -rf "$dest" && mkdir -p "$dest"
# the tracked and untracked-not-ignored files, as the device tool itself sends a checkout
git -C "$here" ls-files -co --exclude-standard -z | (cd "$here" && xargs -0 cp --parents -t "$dest")
git -C "$here" rev-parse --short HEAD > "$dest/COMMIT"
mkdir -p "$dest/wheels"
# torchtitan 0.3.0 and what it imports that the GPU image lacks; megatron-core (cp312: the GPU machine's python).
# WHEELS="megatron_core-0.19.2" carries only those; a wheel missing from $main/.whl is named and left out
# (its contenders then say in their rows that the package does not import).
# WHEELS=unsloth: bench_lora's set (bench/device/lora_unsloth.sh says what each is for and how it was chosen).
# Wheels named in bench/device/slim_wheel.py's DROP (unsloth, bitsandbytes) travel without what the GPU
# machine never loads (unsloth's web UI, bitsandbytes' CUDA 11/12, ROCm and XPU libraries, the CUDA 12
# runtime's headers).
unsloth_set="unsloth-2026.10.9 unsloth_zoo-2026.10.9 trl-1.15.0 datasets-4.8.5 dill-0.4.1 multiprocess-0.70.19 \
    xformers-0.0.35 nvidia_cuda_runtime_cu12-12.9.79 peft-0.21.2 transformers-5.17.0 bitsandbytes-0.50.2 \
    liger_kernel-0.8.5"
wheels=${WHEELS:-torchtitan-0.3.0 spmd_types-0.2.3 tyro-1.0.17 docstring_parser-0.18.0 typeguard-4.6.1 \
    torchdata-0.11.0 torch_checkpointing-0.1.1 megatron_core-0.19.2}
[ "$wheels" = unsloth ] && wheels=$unsloth_set
for w in $wheels; do
    found=("$main"/.whl/"$w"-*.whl)
    if [ -e "${found[0]}" ]; then
        python3 "$here/bench/device/slim_wheel.py" "${found[0]}" "$dest/wheels" > /dev/null
    else
        echo "not carried: no $main/.whl/$w-*.whl"
    fi
done
du -sh "$dest" "$dest/wheels"
