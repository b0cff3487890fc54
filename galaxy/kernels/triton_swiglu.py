"""SwiGLU activation ``silu(gate) * up`` as elementwise Triton kernels.

Backward recomputes ``silu(gate)`` from the saved inputs instead of saving the activation,
so nothing beyond gate and up is kept for backward.

The kernels see gate and up as ``[rows, width]`` with their own row strides (unit stride along a
row), so they also read the packed output ``[gate | up]`` of a fused gate/up projection in place
(``TritonSwiGLUPacked``) and write its gradient back in that layout, with no split or concat.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from galaxy.kernels._triton_utils import warps_for

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n_elements, width, stride_g, stride_u, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    row = offs // width
    col = offs - row * width
    g = tl.load(G + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n_elements, width, stride_g, stride_u, stride_dg, stride_du,
                       BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    row = offs // width
    col = offs - row * width
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + row * stride_du + col, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    # d silu/dg = sig * (1 + g * (1 - sig))
    tl.store(DG + row * stride_dg + col, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty),
             mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., width]`` as ``[rows, width]`` with unit stride along a row (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _forward(gate2: torch.Tensor, up2: torch.Tensor, out_shape) -> torch.Tensor:
    y = torch.empty(out_shape, dtype=gate2.dtype, device=gate2.device)
    n = gate2.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate2, up2, y, n, gate2.shape[1], gate2.stride(0),
                                                     up2.stride(0), BLOCK_SIZE=BLOCK, num_warps=warps_for(BLOCK))
    return y


def _backward(dy: torch.Tensor, gate2: torch.Tensor, up2: torch.Tensor, dgate2: torch.Tensor,
              dup2: torch.Tensor) -> None:
    n = gate2.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            dy.contiguous(), gate2, up2, dgate2, dup2, n, gate2.shape[1], gate2.stride(0), up2.stride(0),
            dgate2.stride(0), dup2.stride(0), BLOCK_SIZE=BLOCK, num_warps=warps_for(BLOCK))


class TritonSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` computed in fp32, stored in the input dtype."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
        if gate.dtype != up.dtype:
            raise ValueError(f"gate ({gate.dtype}) and up ({up.dtype}) must have the same dtype")
        shape = gate.shape
        gate2, up2 = _rows(gate), _rows(up)
        ctx.save_for_backward(gate2, up2)
        ctx.shape = shape
        return _forward(gate2, up2, shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate2, up2 = ctx.saved_tensors
        dgate = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        dup = torch.empty(up2.shape, dtype=up2.dtype, device=up2.device)
        _backward(dy, gate2, up2, dgate, dup)
        return dgate.view(ctx.shape), dup.view(ctx.shape)


class TritonSwiGLUPacked(torch.autograd.Function):
    """``silu(a) * b`` for ``gate_up = [a | b]`` along the last dim (each half ``width`` wide);
    the gradient comes back packed the same way."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up's last dim must hold two equal halves, got {tuple(gate_up.shape)}")
        width = gate_up.shape[-1] // 2
        packed = _rows(gate_up)
        ctx.save_for_backward(packed)
        ctx.shape = gate_up.shape
        return _forward(packed[:, :width], packed[:, width:], gate_up.shape[:-1] + (width,))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (packed,) = ctx.saved_tensors
        width = packed.shape[1] // 2
        grad = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        _backward(dy, packed[:, :width], packed[:, width:], grad[:, :width], grad[:, width:])
        return grad.view(ctx.shape)
