"""float8 (e4m3) storage of frozen weights, and the linear that multiplies on the fp8 tensor cores.

Storage: a matrix ``[rows, cols]`` (the stored orientation, ``galaxy.loralib.quantized``: ``W [out, in]``,
or ``W^T [in, out]`` for a row-parallel linear) keeps per row an fp32 ``scale = amax / 448`` and the row
divided by it, rounded to ``torch.float8_e4m3fn``: 1 byte a weight and 4 a row. A row is quantized on its
own, so a shard of whole rows holds the serial quantization of those rows, as with NF4 and int8.

Products (``fp8_linear``): the frozen base needs ``y = x W^T`` forward and ``dx = dy W`` backward, never a
weight gradient. With ``S = diag(s) Q`` the stored matrix (codes ``Q``, row scales ``s``), one of the two
contracts over S's columns and the other over its rows:

* ``direct``: ``a [M, cols] -> a S^T``: ``a`` quantized per row, ``S^T = Q^T`` is ``[cols, rows]``
  column-major as stored, and ``s`` is ``_scaled_mm``'s per-column ``scale_b``;
* ``folded``: ``a [M, rows] -> a S = (a diag(s)) Q``: ``s`` is folded into ``a``'s columns before ``a`` is
  quantized per row, and ``Q`` is transposed on the fly into the column-major operand ``_scaled_mm`` takes
  (1 byte a weight, transient; a compiled layer fuses it into a copy kernel).

``W [out, in]`` runs direct forward and folded backward (``dy`` times the output rows' scales); ``W^T``
the other way round. The activation side of each product is quantized per token row (its amax / 448,
e4m3; ``galaxy.kernels.fp8``), ``dy`` too: e4m3 rather than e5m2, because the row scale already fits each
row's range, where e4m3's third mantissa bit halves the rounding error e5m2's wider exponent would not
use, and because torch's row-wise ``_scaled_mm`` (CUTLASS on sm90) takes e4m3 operands.

Parallel plans: a TP shard holds whole stored rows, and the folded product contracts over them, so a
token row of its operand is split over the mp ranks: its amax is the maximum over them (one all-reduce of
``[tokens]`` fp32 scalars), so every rank quantizes the same row with the serial scale, and the sums over
ranks are serial's up to float summation order. The direct product's operand is whole on every rank
(replicated, or the rank's own tokens under SP).

Where the product runs: ``torch._scaled_mm`` (row-wise scales, bf16 output; fast accumulation forward and
full fp32 accumulation for the input gradient, as torchao's float8 recipes; the same call in torch 2.11 and
2.13) on a CUDA device of compute capability 8.9+ when both dims of the stored matrix are multiples of 16;
else (other dims, fp32/fp64 compute, the CPU) the same fp8 values multiplied in the compute dtype (exact
products of e4m3 values; fp32 for fp16) and scaled after: the fallback's numbers are the tensor cores' up to
summation order, and bf16 rounds the unscaled product once more. A weight whose dims keep it off the tensor
cores says so once, when it is made.

The activation's quantization: eager, the Triton kernel (one pass); in a compiled layer, torch ops that
inductor fuses into the op that produced the activation (a norm, the MLP's activation).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol

from galaxy.core.comm import Communicator
from galaxy.kernels.fp8 import (E4M3, TENSOR_CORE_MULTIPLE, FP8Matrix, cast_rows, quantize_rows,  # noqa: F401
                                quantize_rows_reference, row_amax, runs_on_tensor_cores, scaled_product)

logger = logging.getLogger(__name__)

@dataclass
class FP8Rows:
    codes: torch.Tensor  # uint8 [rows, cols]: the e4m3 bits (stored as bytes: a model cast leaves them alone)
    scale: torch.Tensor  # fp32 [rows]: amax / 448

    @property
    def cols(self) -> int:
        return self.codes.shape[1]

    def values(self) -> torch.Tensor:
        """The codes as ``float8_e4m3fn`` (a view)."""
        return self.codes.view(E4M3)


@torch.no_grad()
def quantize_fp8(w: torch.Tensor) -> FP8Rows:
    """Quantize ``w [rows, cols]`` row by row (computed in fp32, the scale's precision)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a matrix, got shape {tuple(w.shape)}")
    codes, scale = quantize_rows_reference(w.float())
    return FP8Rows(codes.view(torch.uint8), scale.view(-1))


def dequantize_fp8(q: FP8Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, cols]`` in ``dtype`` (products in fp32, or fp64 for fp64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.values().to(compute) * q.scale.to(compute).view(-1, 1)).to(dtype)


@functools.lru_cache(maxsize=None)
def note_off_tensor_cores(rows: int, cols: int) -> None:
    """Said once per shape: a stored ``[rows, cols]`` matrix whose dims keep it off ``_scaled_mm``."""
    logger.warning("fp8 base: a stored [%d, %d] weight has a dim that is not a multiple of %d, which "
                   "torch._scaled_mm needs; its products run on the fp8 values in bf16 (the same numbers, no fp8 "
                   "speed)", rows, cols, TENSOR_CORE_MULTIPLE)


def _row_max_over(amax: torch.Tensor, comm: Communicator, phase: str) -> torch.Tensor:
    """The rows' amax over the ranks that hold pieces of them (an all-reduce MAX of one scalar a row)."""
    amax = amax.contiguous()
    return comm.timed("all_reduce", amax.numel() * amax.element_size(), phase,
                      lambda: funcol.wait_tensor(funcol.all_reduce(amax, "max", comm.process_group)), amax.device)


def direct(a: torch.Tensor, q: FP8Rows, quantizer: str, tensor_cores: bool, phase: str) -> torch.Tensor:
    """``a S^T`` for ``a [M, cols]``: ``[M, rows]`` (``phase``: fwd | bwd)."""
    return FP8Matrix(q.values(), q.scale, tensor_cores).times_transposed(a, quantizer, phase == "fwd")


def folded(a: torch.Tensor, q: FP8Rows, comm: Optional[Communicator], quantizer: str, tensor_cores: bool,
           phase: str) -> torch.Tensor:
    """``a S`` for ``a [M, rows]`` (this rank's rows): ``[M, cols]``, partial over ``comm`` when the rows are
    sharded over it."""
    if comm is not None and comm.size > 1:
        amax = _row_max_over(row_amax(a, q.scale), comm, phase)
        a_codes, a_scale = cast_rows(a, amax, q.scale)
    else:
        a_codes, a_scale = quantize_rows(a, q.scale, quantizer)
    return scaled_product(a_codes, a_scale, q.values(), None, a.dtype, tensor_cores, phase == "fwd")


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, codes, scale, transposed: bool, comm, quantizer: str, tensor_cores: bool):
        q = FP8Rows(codes, scale)
        x2 = x.reshape(-1, x.shape[-1])
        if transposed:
            y = folded(x2, q, comm, quantizer, tensor_cores, "fwd")
        else:
            y = direct(x2, q, quantizer, tensor_cores, "fwd")
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(codes, scale)  # the stored buffers themselves: nothing of x is kept
        ctx.transposed, ctx.comm, ctx.quantizer, ctx.tensor_cores = transposed, comm, quantizer, tensor_cores
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        codes, scale = ctx.saved_tensors
        q = FP8Rows(codes, scale)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dbias = None
        if ctx.needs_input_grad[0]:  # dx = dy W: the other product of the same stored matrix
            if ctx.transposed:
                dx = direct(dy2, q, ctx.quantizer, ctx.tensor_cores, "bwd")
            else:
                dx = folded(dy2, q, ctx.comm, ctx.quantizer, ctx.tensor_cores, "bwd")
            dx = dx.view(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            dbias = dy2.sum(0)
        return dx, dbias, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, q: FP8Rows, bias: Optional[torch.Tensor] = None, transposed: bool = False,
               comm: Optional[Communicator] = None, backend: str = "auto", tensor_cores: bool = False) -> torch.Tensor:
    """``x W^T + b`` with W stored in fp8 (``transposed``: stored as ``W^T``), in the autocast dtype when
    autocast is on, else in ``x``'s dtype; only ``x`` (and a trainable bias) get gradients. ``comm``: the group
    the stored rows are sharded over (None: whole); ``backend``: the eager quantization (``kernels``)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    # Inside a compiled layer the torch ops are traced, for inductor to fuse into the activation's producer.
    quantizer = "torch" if torch.compiler.is_compiling() else backend
    with torch.autocast(device_type, enabled=False):
        return _FP8Linear.apply(x, bias, q.codes, q.scale, transposed, comm, quantizer, tensor_cores)


__all__ = ["FP8Rows", "quantize_fp8", "dequantize_fp8", "fp8_linear", "scaled_product", "runs_on_tensor_cores"]
