"""Row-wise int8 storage of frozen weights: bitsandbytes' LLM.int8() weight format
(``int8_vectorwise_quant`` without outlier columns): each row keeps its absmax (fp32) and
``round(w * 127 / absmax)`` as int8; dequantized as ``code * absmax / 127`` (bitsandbytes multiplies
by the fp32 reciprocal 1/127). A row is quantized on its own, so a shard of whole rows holds the
serial quantization of those rows, as with NF4 (``galaxy.loralib.nf4``). 1 byte a weight + 4 a row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from galaxy.loralib.quantized_linear import dequantized_linear

INV_127 = 7.874015718698502e-3  # bitsandbytes' 1 / 127


@dataclass
class Int8Rows:
    codes: torch.Tensor  # int8 [rows, cols]
    absmax: torch.Tensor  # fp32 [rows]

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.codes.shape[1]


@torch.no_grad()
def quantize_int8(w: torch.Tensor) -> Int8Rows:
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a matrix, got shape {tuple(w.shape)}")
    x = w.float()
    absmax = x.abs().amax(dim=1)
    return Int8Rows(torch.round(x * (127.0 / absmax.unsqueeze(-1))).to(torch.int8), absmax)


def dequantize_int8(q: Int8Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, cols]`` in ``dtype`` (computed in fp32, or fp64 for fp64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.codes.to(compute) * q.absmax.to(compute).view(-1, 1) * INV_127).to(dtype)


def int8_linear(x: torch.Tensor, q: Int8Rows, bias: Optional[torch.Tensor] = None,
                transposed: bool = False) -> torch.Tensor:
    """``x W^T + b`` with W stored row-wise int8 (``transposed``: stored as ``W^T``)."""
    return dequantized_linear(x, lambda dtype: dequantize_int8(q, dtype), bias, transposed)
