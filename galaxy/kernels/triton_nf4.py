"""Triton NF4 dequantization: one launch from the stored codes (NF4 codes, 8-bit absmax codes,
their block scales and row offsets) to the matrix in the compute dtype, for cuBLAS to multiply.

Measured on an H100 (bench/bench_nf4.py), a kernel that dequantized W tiles inside the matmul
was 10-50x slower than this plus cuBLAS at 4096 tokens (every row tile dequantizes the same
weight tile again) and no faster at 16; training runs thousands of tokens, so the weight is
dequantized once per matmul instead (0.5 + 2 bytes a weight moved, a few microseconds).
The arithmetic is the torch reference's (``galaxy.loralib.nf4.dequantize_nf4``) and bitsandbytes':
absmax = code8 * scale + offset and value = nf4 * absmax in fp32, rounded to the output dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _nf4_dequantize_kernel(packed_ptr, code8_ptr, scale_ptr, offset_ptr, nf4_ptr, dyn_ptr, out_ptr,
                           cols, row_bytes, stride_p, stride_c, stride_s, stride_o,
                           QBLOCK: tl.constexpr, SBLOCK: tl.constexpr, BYTES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BYTES + tl.arange(0, BYTES)  # byte index in the row: elements 2b, 2b + 1
    inside = b < row_bytes
    byte = tl.load(packed_ptr + row * stride_p + b, mask=inside, other=0).to(tl.int32)
    block = (2 * b) // QBLOCK
    code8 = tl.load(code8_ptr + row * stride_c + block, mask=inside, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + row * stride_s + block // SBLOCK, mask=inside, other=0.0)
    # Product and sum rounded apart, as torch and bitsandbytes do: the select keeps the compiler from
    # contracting them into one fused multiply-add, so the result is the reference's bit for bit.
    product = tl.where(inside, tl.load(dyn_ptr + code8) * scale, 0.0)
    absmax = product + tl.load(offset_ptr + row)
    high = tl.load(nf4_ptr + (byte >> 4)) * absmax
    low = tl.load(nf4_ptr + (byte & 15)) * absmax
    values = tl.interleave(high, low).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    c = tl.program_id(1) * 2 * BYTES + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + row * stride_o + c, values, mask=c < cols)


def nf4_dequantize(packed: torch.Tensor, absmax_code: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, cols: int, nf4_values: torch.Tensor, absmax_values: torch.Tensor,
                   block: int, scale_block: int, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, cols]`` in ``dtype`` (fp32/bf16/fp16) from the stored codes of an NF4 matrix stored row by
    row (``galaxy.loralib.nf4_format.NF4Rows``): ``packed`` uint8 ``[rows, bytes]``, ``absmax_code`` uint8
    ``[rows, blocks]``, ``absmax_scale`` ``[rows, ceil(blocks / scale_block)]``, ``absmax_offset`` ``[rows]``,
    and the two code books (16 NF4 values, 256 absmax values, fp32 on the device)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton NF4 dequantization writes fp32/bf16/fp16, not {dtype}")
    rows, row_bytes = packed.shape
    out = torch.empty(rows, cols, dtype=dtype, device=packed.device)
    per_program = min(1024, triton.next_power_of_2(row_bytes))
    grid = (rows, triton.cdiv(row_bytes, per_program))
    offset = absmax_offset.float().contiguous()
    scale = absmax_scale.float()
    _nf4_dequantize_kernel[grid](packed, absmax_code, scale, offset, nf4_values, absmax_values, out, cols, row_bytes,
                                 packed.stride(0), absmax_code.stride(0), scale.stride(0), out.stride(0),
                                 QBLOCK=block, SBLOCK=scale_block, BYTES=per_program, num_warps=4)
    return out
