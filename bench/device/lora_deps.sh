# Sourced by the bench_lora device scripts (lora_unsloth.sh, long_context.sh, fp8_lora.sh): the carried wheels
# (lora_unsloth.sh's header says which and why) installed under DEPS, and the environment a launch runs in.

# Install ./wheels into DEPS: common (bitsandbytes, liger-kernel: on every contender's path), cu12 (the CUDA 12
# runtime xformers links: LD_LIBRARY_PATH only), unsloth (the rest: first on the unsloth contenders' path only).
install_lora_deps() {
    local deps=$1 need n
    local pip="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
    rm -rf "$deps" && mkdir -p "$deps/common" "$deps/unsloth" "$deps/cu12"
    $pip --target "$deps/common" wheels/bitsandbytes-*.whl wheels/liger_kernel-*.whl || return 1
    $pip --target "$deps/cu12" wheels/nvidia_cuda_runtime_cu12-*.whl || return 1
    $pip --target "$deps/unsloth" wheels/unsloth-*.whl wheels/unsloth_zoo-*.whl wheels/trl-*.whl \
        wheels/datasets-*.whl wheels/dill-*.whl wheels/multiprocess-*.whl wheels/xformers-*.whl || return 1
    # peft / transformers of the image where they meet unsloth's own requirements, else the carried ones
    need=$(PYTHONPATH=$deps/unsloth python3 - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
need = []
for req in map(Requirement, md.requires("unsloth") or []):
    if req.name in ("transformers", "peft") and req.marker is None:
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        ok = have is not None and req.specifier.contains(have, prereleases=True)
        print(f"image {req.name} {have}: {'meets' if ok else 'fails'} unsloth's {req.specifier}", flush=True,
              file=__import__("sys").stderr)
        need += [] if ok else [req.name]
print(" ".join(need))
EOF
) || return 1
    for n in $need; do
        $pip --target "$deps/unsloth" wheels/"$n"-*.whl || return 1
        echo "carried $n for unsloth"
    done
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
        'cuda', torch.version.cuda)"
}

# The environment of a bench_lora launch over DEPS (run from the carried tree's copy).
lora_env() {
    local deps=$1
    export LD_LIBRARY_PATH=$deps/cu12/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export GALAXY_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown) PYTHONPATH=$deps/common:$PWD PYTHONUNBUFFERED=1
}

# Copy DIR's files of launch TAG (JSON when done, log so far, console, clocks) to $OUT and say where it stands.
collect_lora() {
    local dir=$1 tag=$2
    cp "$dir/$tag".* "$dir/clocks_$tag.csv" "${OUT:-/tmp}/" 2>/dev/null
    grep -c '^{"contender"' "$dir/$tag.log" 2>/dev/null | sed 's/^/rows so far: /'
    if [ -e "$dir/$tag.done" ]; then
        echo done; tail -16 "$dir/$tag.log"
    else
        echo "still running: call wait again"; tail -3 "$dir/$tag.log"
    fi
}
