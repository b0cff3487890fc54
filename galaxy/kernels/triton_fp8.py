"""Triton row-wise e4m3 quantization (``galaxy.kernels.fp8``): one program per row reads the row once,
keeps it in registers, and writes its codes and its scale (amax / 448): the eager path's one pass where
the torch ops take four (abs, amax, divide, cast). Its arithmetic is ``quantize_rows_reference``'s, bit
for bit (tests/kernels/test_fp8.py, under the interpreter).

The rounding to e4m3 is done in fp32 before the cast (ties to even, by adding and subtracting 1.5 * 2^23
at the e4m3 spacing of each value), so the cast itself is exact: the hardware cast rounds the same way,
but Triton's interpreter rounds a carry into the next binade wrongly (7.8 -> 4), and this kernel is
tested through it."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from galaxy.kernels._triton_utils import as_rows, row_block


@triton.jit
def _fp8_quantize_rows_kernel(a_ptr, col_scale_ptr, codes_ptr, scale_ptr, cols, stride_a, stride_codes,
                              FLOOR: tl.constexpr, LIMIT: tl.constexpr, HAS_COL_SCALE: tl.constexpr,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = c < cols
    v = tl.load(a_ptr + row * stride_a + c, mask=inside, other=0.0).to(tl.float32)
    if HAS_COL_SCALE:
        v = v * tl.load(col_scale_ptr + c, mask=inside, other=0.0)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), FLOOR), LIMIT)
    q = tl.clamp(tl.math.div_rn(v, scale), -LIMIT, LIMIT)
    magnitude = tl.abs(q)
    # The e4m3 spacing at this magnitude, 2^(e - 3) for a normal value of exponent e, 2^-9 below the normals
    # (2^-6), as fp32 bit patterns of the power of two and of its inverse.
    exponent = tl.maximum((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6) - 3
    spacing = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    rounded = ((magnitude * inverse + 12582912.0) - 12582912.0) * spacing
    negative = q.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0.0, as torch's cast keeps it
    q = tl.where(negative, -rounded, rounded)
    tl.store(codes_ptr + row * stride_codes + c, q.to(codes_ptr.dtype.element_ty), mask=inside)
    tl.store(scale_ptr + row, scale)


def fp8_quantize_rows(a: torch.Tensor, col_scale: Optional[torch.Tensor], codes_dtype: torch.dtype, limit: float,
                      floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[rows, cols]`` in ``codes_dtype`` (e4m3: ``limit`` 448), fp32 scales ``[rows, 1]``, each
    ``max(amax, floor) / limit``) of ``a`` (fp32/bf16/fp16, ``[..., cols]`` flattened to rows), each row first
    multiplied by ``col_scale`` ``[cols]`` when given."""
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton fp8 quantization reads fp32/bf16/fp16, not {a.dtype}")
    rows_of_a = as_rows(a)
    rows, cols = rows_of_a.shape
    codes = torch.empty(rows, cols, dtype=codes_dtype, device=a.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=a.device)
    if rows == 0:
        return codes, scale
    block, warps = row_block(cols)
    col = col_scale.float().contiguous() if col_scale is not None else rows_of_a
    _fp8_quantize_rows_kernel[(rows,)](rows_of_a, col, codes, scale, cols, rows_of_a.stride(0), codes.stride(0),
                                       FLOOR=floor, LIMIT=limit, HAS_COL_SCALE=col_scale is not None,
                                       BLOCK=block, num_warps=warps)
    return codes, scale
