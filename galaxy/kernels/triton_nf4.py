"""Triton NF4 dequantize-and-matmul: ``y = x @ B`` where B is the stored NF4 matrix S
(``transpose_s``: ``B = S^T``), dequantized tile by tile in registers, never written to memory.
The torch reference is ``galaxy.kernels.nf4.dequantize_nf4`` followed by a matmul; the product
of a code and its absmax is rounded to ``x``'s dtype as there, and accumulation is fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from galaxy.kernels._triton_utils import KERNELS_INTERPRETED
from galaxy.kernels.nf4 import BLOCK, NF4Rows, _nf4_code


@triton.jit
def _nf4_matmul_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, y_ptr, M, N, K,
                       stride_xm, stride_xk, stride_p, stride_a, stride_ym, stride_yn,
                       TRANSPOSE_S: tl.constexpr, QBLOCK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    # Grouped program order: GROUP_M row tiles share each column tile's weights in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        if TRANSPOSE_S:  # S [N, K]: B[k, n] = S[n, k]
            r = offs_n[None, :] + 0 * ks[:, None]
            c = ks[:, None] + 0 * offs_n[None, :]
        else:  # S [K, N]: B[k, n] = S[k, n]
            r = ks[:, None] + 0 * offs_n[None, :]
            c = offs_n[None, :] + 0 * ks[:, None]
        inside = (ks[:, None] < K) & (offs_n[None, :] < N)
        byte = tl.load(packed_ptr + r * stride_p + c // 2, mask=inside, other=0).to(tl.int32)
        nibble = tl.where(c % 2 == 0, byte >> 4, byte & 15)
        value = tl.load(code_ptr + nibble)
        absmax = tl.load(absmax_ptr + r * stride_a + c // QBLOCK, mask=inside, other=0.0)
        w = (value * absmax).to(x.dtype)
        if UPCAST:  # bf16 x bf16 products are exact in fp32: the same sums, on a path the interpreter runs
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _tiles(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); small tiles under the interpreter."""
    if KERNELS_INTERPRETED:
        return 16, 32, 32, 4, 1
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 64, 64, 4, 4
    return 128, 128, 64, 8, 3


def nf4_matmul(x: torch.Tensor, q: NF4Rows, absmax: torch.Tensor, transpose_s: bool) -> torch.Tensor:
    """``x [M, K] @ S^T`` (``transpose_s``, S ``[N, K]``) or ``x @ S`` (S ``[K, N]``), S in NF4
    with fp32 ``absmax [rows, blocks]`` (already double-dequantized); output in ``x``'s dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton NF4 matmul takes fp32/bf16/fp16 inputs, got {x.dtype}")
    m, k = x.shape
    n = q.rows if transpose_s else q.cols
    if k != (q.cols if transpose_s else q.rows):
        raise ValueError(f"x has {k} features but the NF4 matrix is {q.rows} x {q.cols} "
                         f"({'transposed' if transpose_s else 'as stored'})")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = _tiles(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _nf4_matmul_kernel[grid](x, q.packed, absmax.contiguous(), _nf4_code(x.device), y, m, n, k,
                             x.stride(0), x.stride(1), q.packed.stride(0), absmax.stride(0), y.stride(0), y.stride(1),
                             TRANSPOSE_S=transpose_s, QBLOCK=BLOCK, IEEE=x.dtype == torch.float32,
                             UPCAST=KERNELS_INTERPRETED,  # its half-precision tl.dot is wrong (triton 3.9)
                            
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
