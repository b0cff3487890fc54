"""RMSNorm and LayerNorm as Triton kernels (forward and backward).

One program per row in the forward pass. The backward pass runs a fixed number of programs
that each loop over rows and accumulate their weight/bias gradient in registers, writing one
partial row each; ``sum_partials`` adds the partial rows up column by column in one more launch
(no atomics, deterministic) and writes the parameter's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from galaxy.kernels._triton_utils import as_rows, persistent_programs, row_block


def bwd_programs_per_sm(n_cols: int) -> int:
    """Programs per SM of the backward kernels (each loops over its rows; more programs keep more
    rows in flight, at the cost of more partial rows to sum). With the row loop pipelined
    ``BWD_STAGES`` deep (bench/bench_kernels.py --variants rms_norm, backward + dweight sum,
    docs/results/kernels_2026-11-26_aace385_{h100,h200}_norms_stages_variants.json, GPU ms): 4096
    columns 1 per SM 0.0432 (H100) / 0.0348 (H200) against 2 per SM 0.0455 / 0.0349; 2048 columns
    2 per SM 0.0253 / 0.0209 against 1 per SM 0.0287 / 0.0247 and 4 per SM 0.0275 / 0.0230; LayerNorm
    at 1024 columns 2 per SM 0.0183 / 0.0174 against 4 per SM 0.0181 / 0.0176."""
    return 1 if n_cols >= 4096 else 2


# Software-pipelining depth of the backward kernels' row loop: the next rows' loads are issued
# while this row computes. Triton's default left the loop unpipelined: the same sweep, 2048 columns
# at 2 per SM, 0.0325 (H100) / 0.0289 ms (H200) unpipelined, 0.0271 / 0.0229 with 3 stages, 0.0253 /
# 0.0209 with 4, 0.0252 / 0.0205 with 5 (4096 columns at 1 per SM: 0.0597 / 0.0550, 0.0460 / 0.0391,
# 0.0432 / 0.0348, 0.0440 / 0.0335).
BWD_STAGES = 4


# Tiles of ``sum_partials``: narrow column tiles give enough programs at hidden sizes of 1-4k. From
# the same sweep: 4.7-5.6 us for 528 partial rows of 2048 or 4096 columns, the steadiest setting
# (torch's sum(0) + cast: 11.4-11.7 us).
SUM_BLOCK_C = 32
SUM_BLOCK_P = 128


@triton.jit
def _sum_partials_kernel(P, OUT, OUT2, n_partials, n_cols, split, stride_p,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < n_partials) & col_mask[None, :]
        acc += tl.load(P + rows[:, None].to(tl.int64) * stride_p + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=cols < split)
    tl.store(OUT2 + (cols - split), total.to(OUT2.dtype.element_ty), mask=(cols >= split) & col_mask)


def sum_partials(partials: torch.Tensor, dtypes: tuple[torch.dtype, ...], block_c: int = SUM_BLOCK_C,
                 block_p: int = SUM_BLOCK_P) -> tuple[torch.Tensor, ...]:
    """Column sums of the fp32 partial rows ``[programs, n_cols]`` (unit column stride) in one launch:
    one output of ``dtypes[0]``, or, given two dtypes, the first and second halves of the columns
    as two tensors (LayerNorm's dweight and dbias). Replaces ``partials.sum(0).to(dtype)``: torch's
    dim-0 reduction of a few hundred rows took a third of the small norms' backward (10.5 of 34 us
    at 2048 x 2048 on H100, docs/results/kernels_2026-11-24_690d2e1_h100.json)."""
    n_partials, n_cols = partials.shape
    split = n_cols // len(dtypes)
    outs = tuple(torch.empty(split, dtype=dt, device=partials.device) for dt in dtypes)
    if n_cols:
        _sum_partials_kernel[(triton.cdiv(n_cols, block_c),)](
            partials, outs[0], outs[-1], n_partials, n_cols, split, partials.stride(0),
            BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4,
        )
    return outs


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    # HF LlamaRMSNorm rounds the normalized value to the input dtype before the weight multiply.
    normed = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Each program owns a contiguous run of rows; the loop bound does not depend on
    # program_id (keeps it a plain int for the interpreter too), the tail is masked.
    for i in tl.range(0, rows_per_program, num_stages=STAGES):
        row64 = pid.to(tl.int64) * rows_per_program + i
        row_ok = row64 < n_rows
        # Row bound folded into the column limit (a block & scalar mask trips the interpreter).
        mask = cols < tl.where(row_ok, n_cols, 0)
        x32 = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row64, mask=row_ok, other=0.0)
        normed = x32 * rstd
        # The weight saw the rounded normalized value in forward, so its grad does too.
        dw_acc += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        d_normed = dy * w
        # d/dx of x*rstd(x): rstd * (g - n * mean(g * n))
        dx = rstd * (d_normed - normed * (tl.sum(d_normed * normed, axis=0) / n_cols))
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


class TritonRMSNorm(torch.autograd.Function):
    """RMSNorm with the HF LlamaRMSNorm casting order; see ``reference.rms_norm``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = as_rows(x)
        weight = weight.contiguous()
        n_rows, n_cols = x2.shape
        if weight.shape != (n_cols,):
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n_cols}")
        y = torch.empty((n_rows, n_cols), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block, warps = row_block(n_cols)
        if n_rows > 0:
            _rms_norm_fwd_kernel[(n_rows,)](
                x2, weight, y, rstd, x2.stride(0), y.stride(0), n_cols, eps, BLOCK_N=block, num_warps=warps
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw_partial = rms_norm_backward(as_rows(dy), x2, weight, rstd)
        dw = sum_partials(dw_partial, (weight.dtype,))[0] if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None


def rms_norm_backward(dy2, x2, weight, rstd, programs_per_sm: int | None = None, stages: int | None = BWD_STAGES):
    """dx and the per-program fp32 partial sums of dweight ([programs, n_cols])."""
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    programs = persistent_programs(x2.device, n_rows, programs_per_sm or bwd_programs_per_sm(n_cols))
    # Every program writes its partial row, so only an empty input needs zeros.
    dw_partial = (torch.empty if n_rows else torch.zeros)((programs, n_cols), dtype=torch.float32, device=x2.device)
    block, warps = row_block(n_cols)
    if n_rows > 0:
        _rms_norm_bwd_kernel[(programs,)](
            dy2, x2, weight, rstd, dx, dw_partial,
            dy2.stride(0), x2.stride(0), dx.stride(0), n_rows, n_cols, triton.cdiv(n_rows, programs),
            BLOCK_N=block, STAGES=stages, num_warps=warps,
        )
    return dx, dw_partial


# ----------------------------------------------------------------------------- LayerNorm


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_cols, eps, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (centered * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    stride_dy, stride_x, stride_dx, stride_partial, n_rows, n_cols, rows_per_program,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Each program owns a contiguous run of rows; the loop bound does not depend on
    # program_id (keeps it a plain int for the interpreter too), the tail is masked.
    for i in tl.range(0, rows_per_program, num_stages=STAGES):
        row64 = pid.to(tl.int64) * rows_per_program + i
        row_ok = row64 < n_rows
        # Row bound folded into the column limit (a block & scalar mask trips the interpreter).
        mask = cols < tl.where(row_ok, n_cols, 0)
        x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row64, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + row64, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dw_acc += dy * xhat
        db_acc += dy
        dxhat = dy * w
        c1 = tl.sum(xhat * dxhat, axis=0) / n_cols
        c2 = tl.sum(dxhat, axis=0) / n_cols
        dx = (dxhat - (xhat * c1 + c2)) * rstd
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * stride_partial + cols, dw_acc, mask=col_mask)
    tl.store(DB_PARTIAL + pid.to(tl.int64) * stride_partial + cols, db_acc, mask=col_mask)


class TritonLayerNorm(torch.autograd.Function):
    """LayerNorm with weight and bias, fp32 statistics, output in ``x.dtype``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = as_rows(x)
        weight, bias = weight.contiguous(), bias.contiguous()
        n_rows, n_cols = x2.shape
        if weight.shape != (n_cols,) or bias.shape != (n_cols,):
            raise ValueError(
                f"weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match hidden size {n_cols}"
            )
        y = torch.empty((n_rows, n_cols), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block, warps = row_block(n_cols)
        if n_rows > 0:
            _layer_norm_fwd_kernel[(n_rows,)](
                x2, weight, bias, y, mean, rstd, x2.stride(0), y.stride(0), n_cols, eps,
                BLOCK_N=block, num_warps=warps,
            )
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape = shape
        ctx.bias_dtype = bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        n_cols = x2.shape[1]
        dx, partials = layer_norm_backward(as_rows(dy), x2, weight, mean, rstd)
        dw_partial, db_partial = partials[:, :n_cols], partials[:, n_cols:]
        want_w, want_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if want_w and want_b:
            dw, db = sum_partials(partials, (weight.dtype, ctx.bias_dtype))
        else:
            dw = sum_partials(dw_partial, (weight.dtype,))[0] if want_w else None
            db = sum_partials(db_partial, (ctx.bias_dtype,))[0] if want_b else None
        return dx.view(ctx.shape), dw, db, None


def layer_norm_backward(dy2, x2, weight, mean, rstd, programs_per_sm: int | None = None,
                        stages: int | None = BWD_STAGES):
    """dx and the per-program fp32 partial sums ``[programs, 2 * n_cols]``: dweight's partial row and
    dbias's side by side, so one ``sum_partials`` launch adds up both."""
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    programs = persistent_programs(x2.device, n_rows, programs_per_sm or bwd_programs_per_sm(n_cols))
    # Every program writes its partial rows, so only an empty input needs zeros.
    partials = (torch.empty if n_rows else torch.zeros)((programs, 2 * n_cols), dtype=torch.float32, device=x2.device)
    block, warps = row_block(n_cols)
    if n_rows > 0:
        _layer_norm_bwd_kernel[(programs,)](
            dy2, x2, weight, mean, rstd, dx, partials[:, :n_cols], partials[:, n_cols:],
            dy2.stride(0), x2.stride(0), dx.stride(0), partials.stride(0), n_rows, n_cols,
            triton.cdiv(n_rows, programs), BLOCK_N=block, STAGES=stages, num_warps=warps,
        )
    return dx, partials
