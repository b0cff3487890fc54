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
wheels=${WHEELS:-torchtitan-0.3.0 spmd_types-0.2.3 tyro-1.0.17 docstring_parser-0.18.0 typeguard-4.6.1 \
    torchdata-0.11.0 torch_checkpointing-0.1.1 megatron_core-0.19.2}
for w in $wheels; do
    cp "$main"/.whl/"$w"-*.whl "$dest/wheels/" 2>/dev/null || echo "not carried: no $main/.whl/$w-*.whl"
done
du -sh "$dest"
