"""SwiGLU activation ``silu(gate) * up`` as elementwise Triton kernels.

Backward recomputes ``silu(gate)`` from the saved inputs instead of saving the activation,
so nothing beyond gate and up is kept for backward.

The kernels see gate and up as ``[rows, width]`` with their own row strides (unit stride along a
row), so they also read the packed output ``[gate | up]`` of a fused gate/up projection in place
(``TritonSwiGLUPacked``) and write its gradient back in that layout, with no split or concat.
Contiguous operands run as one flat row (no per-element row/column arithmetic); strided ones as
(row, column block) programs in row order. An earlier version split a flat int64 index into row and column
per element: the 64-bit division made it slower than torch (issue 17).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from galaxy.kernels._triton_utils import as_rows

# Elements per program and warps; chosen by bench/bench_kernels.py --variants (swiglu rows).
BLOCK = 2048
WARPS = 8


@triton.jit
def _block_offsets(width, FLAT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """(row, columns) of this program: flat programs walk one long row; otherwise consecutive
    programs take consecutive blocks of a row (one scalar division per program), so the grid
    streams through memory in order."""
    pid = tl.program_id(0).to(tl.int64)
    if FLAT:
        row = 0
        cols = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    else:
        blocks_per_row = tl.cdiv(width, BLOCK_SIZE)
        row = pid // blocks_per_row
        cols = (pid - row * blocks_per_row) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    return row, cols


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, width, stride_g, stride_u, stride_y, FLAT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    row, cols = _block_offsets(width, FLAT, BLOCK_SIZE)
    mask = cols < width
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, width, stride_dy, stride_g, stride_u, stride_dg, stride_du,
                       FLAT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    row, cols = _block_offsets(width, FLAT, BLOCK_SIZE)
    mask = cols < width
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + row * stride_du + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    # d silu/dg = sig * (1 + g * (1 - sig))
    tl.store(DG + row * stride_dg + cols, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty),
             mask=mask)


def _launch(kernel, tensors, block: int, warps: int) -> None:
    """Run ``kernel`` over [rows, width] operands: flat when every operand is dense, else 2-D."""
    rows, width = tensors[0].shape
    if rows * width == 0:
        return
    strides = [t.stride(0) for t in tensors]
    if all(s == width for s in strides) or rows == 1:
        kernel[(triton.cdiv(rows * width, block),)](*tensors, rows * width, *strides, FLAT=True,
                                                    BLOCK_SIZE=block, num_warps=warps)
    else:
        kernel[(rows * triton.cdiv(width, block),)](*tensors, width, *strides, FLAT=False,
                                                    BLOCK_SIZE=block, num_warps=warps)


def swiglu_forward(gate2: torch.Tensor, up2: torch.Tensor, block: int = BLOCK, warps: int = WARPS) -> torch.Tensor:
    """``silu(gate2) * up2`` for [rows, width] views; returns a new contiguous [rows, width]."""
    y = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
    _launch(_swiglu_fwd_kernel, (gate2, up2, y), block, warps)
    return y


def swiglu_backward(dy: torch.Tensor, gate2: torch.Tensor, up2: torch.Tensor, dgate2: torch.Tensor,
                    dup2: torch.Tensor, block: int = BLOCK, warps: int = WARPS) -> None:
    """Writes the gradients of ``silu(gate2) * up2`` into ``dgate2`` and ``dup2``."""
    _launch(_swiglu_bwd_kernel, (as_rows(dy), gate2, up2, dgate2, dup2), block, warps)


class TritonSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` computed in fp32, stored in the input dtype."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
        if gate.dtype != up.dtype:
            raise ValueError(f"gate ({gate.dtype}) and up ({up.dtype}) must have the same dtype")
        gate2, up2 = as_rows(gate), as_rows(up)
        ctx.save_for_backward(gate2, up2)
        ctx.shape = gate.shape
        return swiglu_forward(gate2, up2).view(gate.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate2, up2 = ctx.saved_tensors
        dgate = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        dup = torch.empty(up2.shape, dtype=up2.dtype, device=up2.device)
        swiglu_backward(dy, gate2, up2, dgate, dup)
        return dgate.view(ctx.shape), dup.view(ctx.shape)


class TritonSwiGLUPacked(torch.autograd.Function):
    """``silu(a) * b`` for ``gate_up = [a | b]`` along the last dim (each half ``width`` wide);
    the gradient comes back packed the same way."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up's last dim must hold two equal halves, got {tuple(gate_up.shape)}")
        width = gate_up.shape[-1] // 2
        packed = as_rows(gate_up)
        ctx.save_for_backward(packed)
        ctx.shape = gate_up.shape
        return swiglu_forward(packed[:, :width], packed[:, width:]).view(gate_up.shape[:-1] + (width,))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (packed,) = ctx.saved_tensors
        width = packed.shape[1] // 2
        grad = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        swiglu_backward(dy.reshape(-1, width), packed[:, :width], packed[:, width:], grad[:, :width], grad[:, width:])
        return grad.view(ctx.shape)
