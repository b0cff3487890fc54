"""Quantized storage of a frozen linear: ``QuantizedWeight`` (NF4, int8 or fp8 buffers of this rank's rows,
no Parameter) and ``QuantLinear``, a frozen ``ParallelLinear`` that computes through it. How a
linear is oriented so that tensor parallelism splits whole rows: ``galaxy.loralib.quantized``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from galaxy.core.comm import Communicator
from galaxy.core.layers import GradRule, ParallelLinear, ShardSpec, grad_rule, set_param_meta, shard_spec
from galaxy.kernels.fp8 import E4M3, FP8Matrix
from galaxy.loralib.fp8 import FP8Rows, dequantize_fp8, fp8_linear, note_off_tensor_cores, quantize_fp8, \
    runs_on_tensor_cores
from galaxy.loralib.int8 import Int8Rows, dequantize_int8, int8_linear, quantize_int8
from galaxy.loralib.nf4 import NF4Rows, dequantize_nf4, nf4_linear, quantize_nf4

# Weights quantized at a time on the host (``QuantizedWeight.quantize_in_blocks``).
HOST_BLOCK = 1 << 16


def row_parallel(linear: nn.Module) -> bool:
    """A linear whose TP form is row-parallel (the input dim is split, ``ParallelLinear.tp_form``): stored
    transposed, so that TP splits whole stored rows."""
    return getattr(linear, "tp_form", None) == "row"


class QuantizedWeight(nn.Module):
    """A frozen weight ``[out, in]`` (this rank's piece) kept quantized row by row, as buffers (dim 0 of
    each is the stored row). ``transposed``: stored as ``W^T``. ``spec``: the piece of the full buffers
    this rank holds (dim 0), or None when whole; ``comm``: the group the rows are sharded over (a format
    whose products sum over the rows needs it: fp8). Subclasses name the buffers and the format."""

    FORMAT = ""
    BUFFERS: tuple[str, ...] = ()
    FP32_BUFFERS: tuple[str, ...] = ()  # scales: part of the format, never cast with the model
    COPY = False  # a copy of a weight the model keeps too: its buffers are not saved, its weights not counted

    def __init__(self, rows, transposed: bool, spec: Optional[ShardSpec], backend: str = "auto",
                 comm: Optional[Communicator] = None):
        super().__init__()
        for name in self.BUFFERS:
            self.register_buffer(name, getattr(rows, name), persistent=not self.COPY)
        self.cols, self.transposed, self.spec, self.backend = rows.cols, transposed, spec, backend
        self.comm = comm if spec is not None else None

    @classmethod
    def quantize(cls, weight: torch.Tensor, spec: Optional[ShardSpec], transposed: bool,
                 backend: str = "auto", comm: Optional[Communicator] = None) -> "QuantizedWeight":
        """Quantize this rank's ``weight`` ``[out, in]``, the piece ``spec`` of the full weight (or all of it)."""
        if spec is not None and spec.dim != (1 if transposed else 0):
            raise ValueError(f"a quantized weight stored {'transposed' if transposed else 'as [out, in]'} must be "
                             f"sharded along its rows, but the shard is along weight dim {spec.dim}")
        rows_spec = ShardSpec(0, spec.sizes, spec.rank) if spec is not None else None
        w = weight.detach()
        return cls(cls.quantize_in_blocks(w.t() if transposed else w), transposed, rows_spec, backend, comm)

    @classmethod
    def quantize_in_blocks(cls, rows: torch.Tensor):
        """``quantize_rows`` of ``rows``; on the host, a block of rows (about ``HOST_BLOCK`` weights) at a
        time: the same buffers (every row is quantized on its own), but the fp32 temporaries stay small
        and the same size, so the allocator reuses them (whole matrices left ~1.5 bytes a weight of holes)."""
        n, cols = rows.shape
        step = max(1, HOST_BLOCK // max(cols, 1)) if rows.device.type == "cpu" else n
        if step >= n:
            return cls.quantize_rows(rows)
        parts = [cls.quantize_rows(rows[i:i + step]) for i in range(0, n, step)]
        return dataclasses.replace(parts[0], **{f.name: torch.cat([getattr(p, f.name) for p in parts])
                                                for f in dataclasses.fields(parts[0])
                                                if isinstance(getattr(parts[0], f.name), torch.Tensor)})

    @staticmethod
    def quantize_rows(w: torch.Tensor):
        raise NotImplementedError

    def dequantize_rows(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # Casting the model (``.to(torch.bfloat16)``, ``.half()``, DeepSpeed's bf16) converts floating
        # buffers; the scales are part of the format and stay fp32 (moved, never rounded).
        kept = {n: getattr(self, n) for n in self.FP32_BUFFERS}
        super()._apply(fn, recurse)
        device = getattr(self, self.BUFFERS[0]).device
        for name, t in kept.items():
            self._buffers[name] = t.to(device)
        return self

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's local ``[out, in]``."""
        r, c = getattr(self, self.BUFFERS[0]).shape[0], self.cols
        return (c, r) if self.transposed else (r, c)

    @property
    def device(self) -> torch.device:
        return getattr(self, self.BUFFERS[0]).device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` (local) in ``dtype``."""
        w = self.dequantize_rows(dtype)
        return w.t().contiguous() if self.transposed else w

    def full_numel(self) -> int:
        """Weights of the full (unsharded) matrix."""
        rows = sum(self.spec.sizes) if self.spec is not None else getattr(self, self.BUFFERS[0]).shape[0]
        return rows * self.cols

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        return f"{self.FORMAT}, shape={self.shape}, transposed={self.transposed}, backend={self.backend}"


class NF4Weight(QuantizedWeight):
    """NF4 (``galaxy.loralib.nf4``): ``packed`` uint8, ``absmax_code`` uint8, ``absmax_scale`` fp32,
    ``absmax_offset`` fp32; ``backend``: the dequantization (``nf4_linear``)."""

    FORMAT = "nf4"
    BUFFERS = ("packed", "absmax_code", "absmax_scale", "absmax_offset")
    FP32_BUFFERS = ("absmax_scale", "absmax_offset")
    quantize_rows = staticmethod(quantize_nf4)

    def rows(self) -> NF4Rows:
        return NF4Rows(self.packed, self.absmax_code, self.absmax_scale, self.absmax_offset, self.cols)

    def dequantize_rows(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nf4(self.rows(), dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return nf4_linear(x, self.rows(), bias, self.transposed, self.backend)


class Int8Weight(QuantizedWeight):
    """Row-wise int8 (``galaxy.loralib.int8``, bitsandbytes' LLM.int8 weights): ``codes`` int8, ``absmax`` fp32."""

    FORMAT = "int8"
    BUFFERS = ("codes", "absmax")
    FP32_BUFFERS = ("absmax",)
    quantize_rows = staticmethod(quantize_int8)

    def rows(self) -> Int8Rows:
        return Int8Rows(self.codes, self.absmax)

    def dequantize_rows(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(self.rows(), dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return int8_linear(x, self.rows(), bias, self.transposed)


class FP8Weight(QuantizedWeight):
    """Row-wise float8 e4m3 (``galaxy.loralib.fp8``): ``codes`` (the e4m3 bits as uint8), ``scale`` fp32;
    products on the fp8 tensor cores (``torch._scaled_mm``) where the device and dims allow."""

    FORMAT = "fp8"
    BUFFERS = ("codes", "scale")
    FP32_BUFFERS = ("scale",)
    quantize_rows = staticmethod(quantize_fp8)

    def __init__(self, rows, transposed: bool, spec: Optional[ShardSpec], backend: str = "auto",
                 comm: Optional[Communicator] = None):
        super().__init__(rows, transposed, spec, backend, comm)
        self.tensor_cores = False
        self._place()

    def _place(self) -> None:
        """Whether the products run on ``_scaled_mm`` where the buffers now are (a dim off its multiple of 16
        said once)."""
        rows, cols = self.codes.shape
        self.tensor_cores = runs_on_tensor_cores(self.codes.device, rows, cols)
        if self.codes.device.type == "cuda" and not self.tensor_cores:
            note_off_tensor_cores(rows, cols)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._place()
        return self

    def rows(self) -> FP8Rows:
        return FP8Rows(self.codes, self.scale)

    def matrix(self) -> FP8Matrix:
        """The stored matrix as the products take it (``galaxy.kernels.fp8``)."""
        return FP8Matrix(self.codes.view(E4M3), self.scale, self.tensor_cores)

    def dequantize_rows(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.rows(), dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fp8_linear(x, self.rows(), bias, self.transposed, self.comm, self.backend, self.tensor_cores)


FORMATS = {"nf4": NF4Weight, "int8": Int8Weight, "fp8": FP8Weight}


class FP8HeadCopy(FP8Weight):
    """A frozen output head's row-wise e4m3 copy, which its logits product multiplies by
    (``galaxy.loralib.quantized.quantize_head``); the head keeps its weight."""

    COPY = True


class QuantLinear(nn.Module):
    """A frozen ``ParallelLinear`` whose weight is a ``QuantizedWeight``: same style, rank and bias
    (a Parameter, so ``lora_bias`` can still train it), same output."""

    def __init__(self, qweight: QuantizedWeight, bias: Optional[nn.Parameter], style: str, rank: int,
                 weight_spec: Optional[ShardSpec], weight_rule: GradRule):
        super().__init__()
        self.qweight, self.bias, self.style, self.rank = qweight, bias, style, rank
        self.weight_spec, self.weight_rule = weight_spec, weight_rule  # what the fp weight's metadata was

    @classmethod
    def from_linear(cls, linear: nn.Module, transposed: bool, kind: str = "nf4", backend: str = "auto",
                    comm: Optional[Communicator] = None) -> "QuantLinear":
        """``comm``: the model's mp group (its TP shards' group), which fp8 products need."""
        w, spec = linear.weight, shard_spec(linear.weight)
        return cls(FORMATS[kind].quantize(w, spec, transposed, backend, comm), linear.bias,
                   getattr(linear, "style", "whole"), getattr(linear, "rank", 0), spec, grad_rule(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qweight.linear(x, self.bias if (self.style != "row" or self.rank == 0) else None)

    def to_linear(self, dtype: torch.dtype = torch.float32) -> ParallelLinear:
        """The equivalent ``ParallelLinear`` with the dequantized weight (for merging and export)."""
        spec = self.weight_spec
        full = list(self.qweight.shape)
        if spec is not None:
            full[spec.dim] = sum(spec.sizes)
        split = spec.sizes if spec is not None else None
        linear = ParallelLinear(full[1], full[0], self.bias is not None, self.style, split, self.rank,
                                rule=self.weight_rule, device=self.qweight.device, dtype=dtype,
                                tp_form="row" if self.qweight.transposed else None)
        with torch.no_grad():
            linear.weight.copy_(self.qweight.dequantize(dtype))
        if self.bias is not None:
            linear.bias = self.bias  # the same Parameter, metadata and all
        set_param_meta(linear.weight, self.weight_rule, spec)
        return linear

    def extra_repr(self) -> str:
        return f"style={self.style}, bias={self.bias is not None}"
