"""The SwiGLU MLP ``down(silu(x Wg^T) * (x Wu^T))`` with the activation inside the GEMMs' epilogues.

A SwiGLU kernel of its own must read gate and up and write the activation (forward), then read the
activation's gradient, gate and up and write both gradients (backward): Liger's runs at the floor
of those bytes (issue 17). Here the gate/up GEMM writes the activation beside gate and up from its
accumulators, and the down projection's input-gradient GEMM turns its accumulator into the gate
and up gradients before anything reaches memory: the activation's gradient is never written and
nothing is read back that the GEMMs did not already hold. The other three GEMMs (the down
projection forward and both weight gradients, and the input gradient) stay with cuBLAS.

Saved for backward: ``x``, ``[gate | up]`` and the activation, as the unfused MLP saves them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from galaxy.kernels._triton_utils import KERNELS_INTERPRETED, as_rows


class Tiles(NamedTuple):
    """A GEMM launch: output tile ``block_m x block_n`` (each of gate and up in the forward), K step,
    pipeline stages, warps, and ``group_m`` row tiles walked together (L2 reuse of weight tiles)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    # A persistent grid (one program per SM walking the tiles) whose tiles move by the copy engine
    # (TMA tensor descriptors); the operands' strides and offsets must then be 16-byte aligned.
    tma: bool = False
    warp_specialize: bool = False  # tma only: loads by producer warps (Triton's automatic warp specialization)


# Chosen by bench/bench_kernels.py --variants (swiglu-mlp rows).
FORWARD_TILES = Tiles(128, 128, 64, 3, 8)
BACKWARD_TILES = Tiles(128, 128, 64, 4, 8)
# Small tiles for the Triton interpreter (CPU tests): it runs every program in Python.
INTERPRETER_TILES = Tiles(16, 16, 16, 1, 1, 2)


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of tile number ``tile``, ``GROUP_M`` row tiles at a time so that
    consecutive tiles share the weight tiles they load."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    return _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def _silu_grads(dh, g, u):
    """The gradients of silu(g) * u for g and u, given the product's gradient ``dh``."""
    sig = tl.sigmoid(g)
    # d silu/dg = sig * (1 + g * (1 - sig))
    return dh * u * sig * (1.0 + g * (1.0 - sig)), dh * g * sig


@triton.jit
def _gate_up_swiglu_tma_kernel(X, WG, WU, G, U, H, M, N, K, ACC: tl.constexpr, UPCAST: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """``_gate_up_swiglu_kernel`` on tensor descriptors (gate and up weights and outputs each their
    own), one program per SM walking the tiles."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for k in range(tl.cdiv(K, BLOCK_K)):
            a = X.load([off_m, k * BLOCK_K])
            wg = WG.load([off_n, k * BLOCK_K])
            wu = WU.load([off_n, k * BLOCK_K])
            if UPCAST:
                a, wg, wu = a.to(ACC), wg.to(ACC), wu.to(ACC)
            acc_g = tl.dot(a, wg.T, acc_g)
            acc_u = tl.dot(a, wu.T, acc_u)
        G.store([off_m, off_n], acc_g.to(G.dtype))
        U.store([off_m, off_n], acc_u.to(U.dtype))
        H.store([off_m, off_n], (acc_g * tl.sigmoid(acc_g) * acc_u).to(H.dtype))


@triton.jit
def _down_dgrad_swiglu_tma_kernel(DY, WD, G, U, DG, DU, M, N, K, ACC: tl.constexpr, UPCAST: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """``_down_dgrad_swiglu_kernel`` on tensor descriptors, one program per SM walking the tiles."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for k in range(tl.cdiv(K, BLOCK_K)):
            a = DY.load([off_m, k * BLOCK_K])
            b = WD.load([k * BLOCK_K, off_n])
            if UPCAST:
                a, b = a.to(ACC), b.to(ACC)
            acc = tl.dot(a, b, acc)
        dg, du = _silu_grads(acc, G.load([off_m, off_n]).to(ACC), U.load([off_m, off_n]).to(ACC))
        DG.store([off_m, off_n], dg.to(DG.dtype))
        DU.store([off_m, off_n], du.to(DU.dtype))


@triton.jit
def _gate_up_swiglu_kernel(X, W, GU, H, M, N, K, stride_x, stride_w, stride_gu, stride_h,
                           EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """GU[:, :N] = X W[:N]^T, GU[:, N:] = X W[N:]^T, H = silu(GU[:, :N]) * GU[:, N:]."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows and columns load a valid row again (wrapped) and are never stored: no
    # masks in the K loop.
    rows_in = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    cols_in = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N).to(tl.int64)
    x_ptrs = X + rows_in[:, None] * stride_x + ks[None, :]
    g_ptrs = W + cols_in[None, :] * stride_w + ks[:, None]  # [BLOCK_K, BLOCK_N] of W[:N]^T
    u_ptrs = g_ptrs + N * stride_w
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=ks[None, :] < left, other=0.0)
            wg = tl.load(g_ptrs, mask=ks[:, None] < left, other=0.0)
            wu = tl.load(u_ptrs, mask=ks[:, None] < left, other=0.0)
        if UPCAST:
            a, wg, wu = a.to(ACC), wg.to(ACC), wu.to(ACC)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    gu_ptrs = GU + rows[:, None].to(tl.int64) * stride_gu + cols[None, :]
    tl.store(gu_ptrs, acc_g.to(GU.dtype.element_ty), mask=mask)
    tl.store(gu_ptrs + N, acc_u.to(GU.dtype.element_ty), mask=mask)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(H + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _down_dgrad_swiglu_kernel(DY, WD, GU, DGU, M, N, K, stride_dy, stride_wd, stride_gu, stride_dgu,
                              EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """DH = DY WD (never stored); DGU = the gradients of silu(g) * u for g, u = GU[:, :N], GU[:, N:]."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rows_in = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    cols_in = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N)
    dy_ptrs = DY + rows_in[:, None] * stride_dy + ks[None, :]
    w_ptrs = WD + ks[:, None].to(tl.int64) * stride_wd + cols_in[None, :]  # [BLOCK_K, BLOCK_N] of WD
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(dy_ptrs)
            b = tl.load(w_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(dy_ptrs, mask=ks[None, :] < left, other=0.0)
            b = tl.load(w_ptrs, mask=ks[:, None] < left, other=0.0)
        if UPCAST:
            a, b = a.to(ACC), b.to(ACC)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        dy_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wd
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    gu_ptrs = GU + rows[:, None].to(tl.int64) * stride_gu + cols[None, :]
    dg, du = _silu_grads(acc, tl.load(gu_ptrs, mask=mask, other=0.0).to(ACC),
                         tl.load(gu_ptrs + N, mask=mask, other=0.0).to(ACC))
    dgu_ptrs = DGU + rows[:, None].to(tl.int64) * stride_dgu + cols[None, :]
    tl.store(dgu_ptrs, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dgu_ptrs + N, du.to(DGU.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: full fp32 products, as torch's matmul does by default (no TF32).
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _accumulator(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter multiplies 16-bit floats in tl.dot wrongly (seen with triton 3.9: errors
    # of 1e10 on unit inputs); it gets them as fp32, exact products of the same values.
    return KERNELS_INTERPRETED and dtype in (torch.bfloat16, torch.float16)


def _grid(m: int, n: int, tiles: Tiles):
    return (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)


def _tiles_for(t: torch.Tensor, tiles: Tiles | None, default: Tiles) -> Tiles:
    if tiles is not None:
        return tiles
    return default if t.is_cuda else INTERPRETER_TILES


def _tma_fits(tiles: Tiles, *tensors: torch.Tensor) -> bool:
    """Tensor descriptors need 16-bit operands here (fp32 would multiply in TF32) with 16-byte
    aligned addresses and row strides."""
    return tiles.tma and all(t.dtype in (torch.bfloat16, torch.float16) and t.data_ptr() % 16 == 0
                             and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _programs(device: torch.device, tiles: int) -> int:
    count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(tiles, count))


def _launch(pointer_kernel, tma_kernel, tiles: Tiles, m: int, n: int, k: int, operands, tma_operands) -> None:
    """One of the two kernels over an [m, n] output from K = k: ``operands`` are (tensor or int) for
    the pointer kernel; ``tma_operands`` are (tensor, block rows, block columns) views for the
    descriptor kernel, used where they all fit it."""
    dtype = operands[0].dtype
    common = dict(ACC=_accumulator(dtype), UPCAST=_upcast(dtype), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, num_stages=tiles.stages, num_warps=tiles.warps)
    if _tma_fits(tiles, *(t for t, _, _ in tma_operands)):
        from triton.tools.tensor_descriptor import TensorDescriptor

        descriptors = [TensorDescriptor.from_tensor(t, [rows, cols]) for t, rows, cols in tma_operands]
        programs = _programs(operands[0].device, _grid(m, n, tiles)[0])
        tma_kernel[(programs,)](*descriptors, m, n, k, PROGRAMS=programs, WARP_SPECIALIZE=tiles.warp_specialize,
                                 **common)
    else:
        pointer_kernel[_grid(m, n, tiles)](*operands, m, n, k, *(t.stride(0) for t in operands),
                                            EVEN_K=k % tiles.block_k == 0, PRECISION=_precision(dtype), **common)


def gate_up_swiglu(x2: torch.Tensor, w_gate_up: torch.Tensor,
                   tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[gate | up] = x2 w_gate_up^T`` and ``silu(gate) * up`` for x2 [rows, hidden] and
    w_gate_up [2 * width, hidden] (gate rows first), both with unit stride along hidden."""
    tiles = _tiles_for(x2, tiles, FORWARD_TILES)
    (m, k), width = x2.shape, w_gate_up.shape[0] // 2
    gate_up = torch.empty((m, 2 * width), dtype=x2.dtype, device=x2.device)
    h = torch.empty((m, width), dtype=x2.dtype, device=x2.device)
    if m and width:
        bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
        _launch(_gate_up_swiglu_kernel, _gate_up_swiglu_tma_kernel, tiles, m, width, k, (x2, w_gate_up, gate_up, h),
                ((x2, bm, bk), (w_gate_up[:width], bn, bk), (w_gate_up[width:], bn, bk),
                 (gate_up[:, :width], bm, bn), (gate_up[:, width:], bm, bn), (h, bm, bn)))
    return gate_up, h


def down_dgrad_swiglu(dy2: torch.Tensor, w_down: torch.Tensor, gate_up: torch.Tensor,
                      tiles: Tiles | None = None) -> torch.Tensor:
    """The gradient of ``[gate | up]`` when the MLP's output gradient is dy2 [rows, hidden] and
    w_down [hidden, width] is the down projection (unit stride along width)."""
    tiles = _tiles_for(dy2, tiles, BACKWARD_TILES)
    (m, k), width = dy2.shape, w_down.shape[1]
    if gate_up.shape != (m, 2 * width) or w_down.shape[0] != k or gate_up.stride(1) != 1:
        raise ValueError(f"down_dgrad_swiglu: dy {tuple(dy2.shape)}, w_down {tuple(w_down.shape)} need gate_up "
                         f"[{m}, {2 * width}] with unit column stride, got {tuple(gate_up.shape)}")
    grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    if m and width:
        bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
        _launch(_down_dgrad_swiglu_kernel, _down_dgrad_swiglu_tma_kernel, tiles, m, width, k,
                (dy2, w_down, gate_up, grad),
                ((dy2, bm, bk), (w_down, bk, bn), (gate_up[:, :width], bm, bn), (gate_up[:, width:], bm, bn),
                 (grad[:, :width], bm, bn), (grad[:, width:], bm, bn)))
    return grad


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonSwiGLUMLP(torch.autograd.Function):
    """``down(silu(x Wg^T) * (x Wu^T))`` for w_gate_up [2 * width, hidden] (gate rows first) and
    w_down [hidden, width], all of one dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        x2, w_gate_up, w_down = as_rows(x), _unit_rows(w_gate_up), _unit_rows(w_down)
        gate_up, h = gate_up_swiglu(x2, w_gate_up)
        ctx.save_for_backward(x2, w_gate_up, w_down, gate_up, h)
        ctx.shape = x.shape
        return torch.mm(h, w_down.t()).view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w_gate_up, w_down, gate_up, h = ctx.saved_tensors
        dy2 = as_rows(dy)
        grad_gate_up = down_dgrad_swiglu(dy2, w_down, gate_up)
        dx = torch.mm(grad_gate_up, w_gate_up).view(ctx.shape) if ctx.needs_input_grad[0] else None
        dw_gate_up = torch.mm(grad_gate_up.t(), x2) if ctx.needs_input_grad[1] else None
        dw_down = torch.mm(dy2.t(), h) if ctx.needs_input_grad[2] else None
        return dx, dw_gate_up, dw_down
