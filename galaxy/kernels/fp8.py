"""Row-wise float8 (e4m3) quantization of activations: each row of ``a`` (a token's features), optionally
multiplied column by column by ``col_scale`` first, is scaled by its own ``amax / 448`` and rounded to
``torch.float8_e4m3fn``, what ``torch._scaled_mm``'s row-wise scaling multiplies. Used by the fp8 frozen
base (``galaxy.loralib.fp8``) on every product's activation operand, and here by the products themselves:
``scaled_product`` (``torch._scaled_mm`` where the device and dims allow, else the same fp8 values multiplied in
the compute dtype) and ``FP8Matrix``, a frozen row-wise e4m3 matrix's ``a W^T``, which a frozen output head's
logits take (``logits_on_fp8``; ``peft.quantize_head``).

``quantize_rows`` dispatches: the Triton kernel (``galaxy.kernels.triton_fp8``: the row's amax and the cast
in one pass over it) or ``quantize_rows_reference``, the torch ops the kernel is tested against and that a
compiled layer traces (there inductor fuses them into the kernel that produces ``a``: a norm, an activation).

Arithmetic (the same in both, bit for bit): fp32 (fp64 for fp64 inputs) ``v = a * col_scale``,
``amax = max |v|`` over the row, ``scale = max(amax, 1e-12) / 448``, ``code = e4m3(clamp(v / scale, ±448))``
rounded to nearest even, the division correctly rounded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from galaxy.kernels._backend import resolve_backend_for

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
AMAX_FLOOR = 1e-12  # a row of zeros gets this amax (torchao's EPS): codes 0, a finite scale
TENSOR_CORE_MULTIPLE = 16  # torch._scaled_mm's requirement on K and N


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the quantization computes in: fp64 for fp64 inputs (the exactness tests), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scaled_rows(a: torch.Tensor, col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a`` (``[rows, cols]``) in the compute dtype, times ``col_scale`` (``[cols]``) when given."""
    v = a.to(compute_dtype(a.dtype))
    return v if col_scale is None else v * col_scale.to(v.dtype)


def row_amax(a: torch.Tensor, col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[rows, 1]``: each row's largest ``|a * col_scale|``."""
    return scaled_rows(a, col_scale).abs().amax(dim=-1, keepdim=True)


def cast_rows(a: torch.Tensor, amax: torch.Tensor, col_scale: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[rows, cols]`` e4m3, scales ``[rows, 1]``) of ``a * col_scale`` with the rows' ``amax`` given
    (a row sharded over ranks takes the maximum over them)."""
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    codes = (scaled_rows(a, col_scale) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes, scale


def quantize_rows_reference(a: torch.Tensor, col_scale: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``quantize_rows``."""
    return cast_rows(a, row_amax(a, col_scale), col_scale)


def quantize_rows(a: torch.Tensor, col_scale: Optional[torch.Tensor] = None, backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the rows of ``a`` ``[rows, cols]``: Triton (``auto`` on CUDA for fp32/bf16/fp16,
    ``triton``) reads each row once; ``torch`` is the reference's four passes in eager mode."""
    if resolve_backend_for(backend, a.device, a.dtype) == "triton":
        from galaxy.kernels.triton_fp8 import fp8_quantize_rows

        return fp8_quantize_rows(a, col_scale, E4M3, E4M3_MAX, AMAX_FLOOR)
    return quantize_rows_reference(a, col_scale)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def runs_on_tensor_cores(device: torch.device, rows: int, cols: int) -> bool:
    """Whether the products of a stored ``[rows, cols]`` fp8 matrix on ``device`` run ``torch._scaled_mm``
    (given a bf16 compute dtype)."""
    if device.type != "cuda" or rows % TENSOR_CORE_MULTIPLE or cols % TENSOR_CORE_MULTIPLE:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


def scaled_product(a_codes: torch.Tensor, a_scale: torch.Tensor, b_codes: torch.Tensor,
                   b_scale: Optional[torch.Tensor], out_dtype: torch.dtype, tensor_cores: bool,
                   fast_accum: bool = False) -> torch.Tensor:
    """``(a_codes @ b_codes) * a_scale * b_scale`` in ``out_dtype``: e4m3 ``a_codes [M, K]`` (row-major),
    ``b_codes [K, N]``, ``a_scale [M, 1]``, ``b_scale [1, N]`` (None: ones). ``tensor_cores``: through
    ``torch._scaled_mm`` when ``out_dtype`` is bf16 (``b_codes`` made column-major if it is not), with its
    fast accumulation when ``fast_accum`` (torchao's recipes take it for the forward product only)."""
    if tensor_cores and out_dtype == torch.bfloat16:
        n = b_codes.shape[1]
        b = b_codes if b_codes.stride(0) == 1 else b_codes.t().contiguous().t()
        sb = b_scale if b_scale is not None else torch.ones(1, n, dtype=torch.float32, device=b.device)
        return torch._scaled_mm(a_codes, b, a_scale.float(), sb.float().contiguous(), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    compute = torch.float32 if out_dtype == torch.float16 else out_dtype  # fp16 would overflow at 448 * 448 * K
    y = (a_codes.to(compute) @ b_codes.to(compute)).to(a_scale.dtype) * a_scale
    if b_scale is not None:
        y = y * b_scale.to(y.dtype)
    return y.to(out_dtype)


@dataclass(frozen=True)
class FP8Matrix:
    """A frozen matrix ``W [rows, cols]`` as row-wise e4m3: ``codes`` (``float8_e4m3fn``), fp32 ``scale``
    ``[rows]``, and whether its products run on ``torch._scaled_mm`` (``runs_on_tensor_cores``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    tensor_cores: bool

    def times_transposed(self, a: torch.Tensor, backend: str = "auto", fast_accum: bool = True) -> torch.Tensor:
        """``a W^T`` for ``a [M, cols]`` (``[M, rows]``, in ``a``'s dtype): ``a`` quantized per row, the
        products on fp8 values. No autograd (``logits_on_fp8`` gives it one)."""
        a_codes, a_scale = quantize_rows(a, None, backend)
        return scaled_product(a_codes, a_scale, self.codes.t(), self.scale.view(1, -1), a.dtype, self.tensor_cores,
                              fast_accum)


class _LogitsOnFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, matrix: FP8Matrix, backend: str):
        ctx.save_for_backward(weight)
        y = matrix.times_transposed(hidden.reshape(-1, hidden.shape[-1]), backend)
        return y.view(*hidden.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return dy @ weight.to(dy.dtype), None, None, None


def logits_on_fp8(hidden: torch.Tensor, weight: torch.Tensor, matrix: FP8Matrix, backend: str = "auto"
                  ) -> torch.Tensor:
    """A frozen output head's ``hidden W^T`` with its forward product on fp8 values (``matrix``: ``weight``'s
    row-wise e4m3) and its input gradient ``dlogits W`` from ``weight`` itself (the head's backward product
    stays in the weight's dtype: the transposed product would need the codes a second time, transposed).
    Under autocast, in the autocast dtype; inside a compiled graph the quantization is traced."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        hidden = hidden.to(torch.get_autocast_dtype(kind))
    quantizer = "torch" if torch.compiler.is_compiling() else backend
    with torch.autocast(kind, enabled=False):
        return _LogitsOnFP8.apply(hidden, weight, matrix, quantizer)


__all__ = ["E4M3", "E4M3_MAX", "AMAX_FLOOR", "TENSOR_CORE_MULTIPLE", "FP8Matrix", "row_amax", "cast_rows",
           "quantize_rows", "quantize_rows_reference", "runs_on_tensor_cores", "scaled_product", "logits_on_fp8"]
