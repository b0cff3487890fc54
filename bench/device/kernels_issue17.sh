#!/usr/bin/env bash
# Issue 17 on one H100. Modes: `explore` = fp32 numerics of cross-entropy and RoPE, launch-setting sweeps
# (RoPE tiles, cross-entropy blocks), Nsight Compute bytes of the cross-entropy kernels, the bf16 bench of
# both with kernel profiles; `ce` = the cross-entropy sweep, bytes and bench; `final` = fp32 numerics, the
# cross-entropy sweep, then the whole bf16 bench with profiles; `norms` = the RMSNorm backward sweep
# (programs per SM, the partial-row sum's tiles), then the norms and RoPE bench with profiles; `floor` =
# the bench of every memory-bound op with profiles, each beside its copy floor.
# Run from the repository root with $OUT and GALAXY_COMMIT set, Liger's wheel installed on PYTHONPATH.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
B="python3 bench/bench_kernels.py --commit $GALAXY_COMMIT"
ce_bytes() {  # DRAM / L2 bytes and time of each cross-entropy kernel (clocks left alone)
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] && timeout 120 "$ncu" --clock-control none --metrics \
    dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum \
    python3 bench/device/ncu_cross_entropy.py > $OUT/ncu_ce.txt 2>&1
}
case "$1" in
  explore)
    timeout 150 $B --dtype fp32 --only cross_entropy rope --skip torch-compile --repeats 1 \
      --json $OUT/kernels_fp32_check.json 2>&1 | grep -E "^(cross_entropy|rope) |FAIL|Error" | tail -30
    timeout 200 $B --variants rope ce --only --json $OUT/kernels_variants.json 2>&1 | grep variant > $OUT/variants.txt
    tail -60 $OUT/variants.txt
    ce_bytes
    timeout 240 $B --only cross_entropy rope --profile --repeats 5 --json $OUT/kernels_ce_rope.json 2>&1 | tail -40 ;;
  ce)
    timeout 70 $B --variants ce --only --json $OUT/kernels_ce_variants.json 2>&1 | grep "variant ce loss+grad"
    ce_bytes
    timeout 150 $B --only cross_entropy --profile --repeats 4 --json $OUT/kernels_ce.json 2>&1 | tail -25 ;;
  norms)
    timeout 150 $B --variants rms_norm --only --json $OUT/kernels_norms_variants.json 2>&1 | grep variant
    timeout 300 $B --only rms_norm layer_norm rope --profile --repeats 4 --json $OUT/kernels_norms_rope.json 2>&1 | tail -40 ;;
  final)
    timeout 100 $B --dtype fp32 --only cross_entropy rope --skip torch-compile liger --repeats 1 \
      --json $OUT/kernels_fp32_check.json 2>&1 | grep -E "^(cross_entropy|rope) .* (ok|FAIL)" | head -20
    timeout 70 $B --variants ce --only --json $OUT/kernels_ce_variants.json 2>&1 | grep "variant ce loss+grad"
    timeout 460 $B --profile --repeats 4 --json $OUT/kernels_final.json 2>&1 | tail -75 ;;
  floor)
    timeout 560 $B --only rms_norm layer_norm rope swiglu swiglu_packed cross_entropy --profile --repeats 4 \
      --json $OUT/kernels_floor.json 2>&1 | tail -60 ;;
  *) echo "usage: $0 explore|ce|norms|final|floor" >&2; exit 2 ;;
esac
