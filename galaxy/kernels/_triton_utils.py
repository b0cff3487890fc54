"""Launch settings shared by the Triton kernels. Imports triton, so only the kernel
modules (loaded lazily by the dispatch functions) import this."""

from __future__ import annotations

import torch
import triton

from galaxy.kernels._backend import triton_interpret_enabled

# @triton.jit picks compiled vs interpreted at decoration time, i.e. when the kernel modules
# (which all import this one) are first imported; resolve_backend checks this flag.
KERNELS_INTERPRETED = triton_interpret_enabled()

# One program normalizes a whole row in registers; beyond this the row does not fit.
MAX_ROW_BLOCK = 65536


def row_block(n_cols: int) -> tuple[int, int]:
    """Block size covering a full row, and a warp count that grows with it."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"row length {n_cols} exceeds the fused-row limit {MAX_ROW_BLOCK}")
    return block, warps_for(block)


def warps_for(block: int) -> int:
    # 16 warps is the largest count valid on both NVIDIA and AMD (64-wide wavefronts).
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def persistent_programs(device: torch.device, n_rows: int, per_sm: int = 1) -> int:
    """Programs for kernels that loop over rows and keep per-program partial sums
    (the weight-gradient reductions): ``per_sm`` per SM on GPU, a few under the interpreter."""
    if device.type == "cuda":
        count = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        count = 4
    return max(1, min(n_rows, count))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View as [rows, last_dim] with unit stride on the last dim (copy only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2
