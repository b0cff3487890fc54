"""Row-wise float8 (e4m3) quantization of activations: each row of ``a`` (a token's features), optionally
multiplied column by column by ``col_scale`` first, is scaled by its own ``amax / 448`` and rounded to
``torch.float8_e4m3fn``, what ``torch._scaled_mm``'s row-wise scaling multiplies. Used by the fp8 frozen
base (``galaxy.loralib.fp8``) on every product's activation operand.

``quantize_rows`` dispatches: the Triton kernel (``galaxy.kernels.triton_fp8``: the row's amax and the cast
in one pass over it) or ``quantize_rows_reference``, the torch ops the kernel is tested against and that a
compiled layer traces (there inductor fuses them into the kernel that produces ``a``: a norm, an activation).

Arithmetic (the same in both, bit for bit): fp32 (fp64 for fp64 inputs) ``v = a * col_scale``,
``amax = max |v|`` over the row, ``scale = max(amax, 1e-12) / 448``, ``code = e4m3(clamp(v / scale, ±448))``
rounded to nearest even, the division correctly rounded.
"""

from __future__ import annotations

from typing import Optional

import torch

from galaxy.kernels._backend import resolve_backend_for

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
AMAX_FLOOR = 1e-12  # a row of zeros gets this amax (torchao's EPS): codes 0, a finite scale


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


__all__ = ["E4M3", "E4M3_MAX", "AMAX_FLOOR", "row_amax", "cast_rows", "quantize_rows", "quantize_rows_reference"]
