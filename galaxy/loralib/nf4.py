"""4-bit NormalFloat (NF4) storage of frozen weights and the dequantize-and-matmul that reads it.

The data type is QLoRA's (Dettmers et al. 2023): 16 values at quantiles of N(0, 1) scaled to
[-1, 1], with an exact zero; a block of 64 weights stores 4-bit codes and its absmax. The absmax
values are double-quantized as bitsandbytes does (``compress_statistics=True``): their mean is
subtracted, the rest quantized blockwise (256 per block) to bitsandbytes' signed 8-bit dynamic type,
with one fp32 scale per block. Two codes share a byte, the first in the high nibble.

Layout: a matrix ``[rows, cols]`` is quantized **row by row**: each row's blocks (of its ``cols``,
zero-padded to a multiple of 64), its absmax blocks of 256 and its offset (the mean) belong to
that row alone. A shard that takes whole rows therefore holds exactly the serial quantization of
those rows, which is what makes every parallel plan equal serial QLoRA (``galaxy.loralib.quantized``
picks the orientation per linear so that tensor parallelism always splits rows). With a single
row this is bitsandbytes' ``quantize_4bit(blocksize=64, compress_statistics=True, quant_type="nf4")``
of the flattened tensor; when ``cols`` is a multiple of 64 the codes and absmax of a matrix are the
flat layout too (bitsandbytes' dequantize kernel reads them as they are), only the offset is per row.

``nf4_linear`` computes ``x @ W^T`` (``transposed=False``: stored ``W [out, in]``) or ``x @ S``
(``transposed=True``: stored ``S = W^T [in, out]``) in the compute dtype, and the input gradient
in backward (the base stays frozen): the weight is dequantized for each matmul (forward, and
again in backward: nothing but the 4-bit storage is kept) and multiplied by cuBLAS. Backends of
the dequantization: ``torch`` (the reference), ``triton`` (one kernel,
``galaxy.kernels.triton_nf4``), ``bnb`` (bitsandbytes' CUDA kernel after a torch absmax step).
Inside a compiled layer (model key ``compile``) the torch reference is traced whatever the backend, and
inductor fuses it into one kernel (``galaxy.loralib.quantized_linear``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from galaxy.kernels import resolve_backend_for
from galaxy.loralib.nf4_format import (BLOCK, DYNAMIC_VALUES, NF4_VALUES, SCALE_BLOCK, NF4Rows, code_book, dynamic_code,
                                      nf4_code)
from galaxy.loralib.quantized_linear import dequantized_linear

NF4_BACKENDS = ("auto", "torch", "triton", "bnb")


def _nearest(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``code`` (ties to the upper one, as bitsandbytes)."""
    return torch.bucketize(values.contiguous(), (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)


@torch.no_grad()
def quantize_nf4(w: torch.Tensor) -> NF4Rows:
    """Quantize ``w [rows, cols]`` (any float dtype; computed in fp32) row by row."""
    if w.dim() != 2:
        raise ValueError(f"quantize_nf4 takes a matrix, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    blocks = -(-cols // BLOCK)
    x = F.pad(w.float(), (0, blocks * BLOCK - cols)).view(rows, blocks, BLOCK)
    absmax = x.abs().amax(dim=-1)
    scaled = (x * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1)).clamp(-1, 1)
    q = _nearest(scaled.reshape(rows, -1), nf4_code(w.device))
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    # Double quantization of the absmax, per row: offset = mean, blocks of 256 of (absmax - offset).
    offset = absmax.mean(dim=1)
    groups = -(-blocks // SCALE_BLOCK)
    centered = F.pad(absmax - offset[:, None], (0, groups * SCALE_BLOCK - blocks)).view(rows, groups, SCALE_BLOCK)
    scale = centered.abs().amax(dim=-1)
    c = (centered * (1.0 / scale.clamp(min=1e-38)).unsqueeze(-1)).clamp(-1, 1)
    absmax_code = _nearest(c.reshape(rows, -1)[:, :blocks].contiguous(), dynamic_code(w.device))
    return NF4Rows(packed.contiguous(), absmax_code, scale.contiguous(), offset.contiguous(), cols)


def _traceable(values: tuple[float, ...], cached, device: torch.device) -> torch.Tensor:
    """A code book: the cached tensor in eager calls; inside a torch.compile graph, a constant of the
    graph made from its values (dynamo would trace through the cache)."""
    return code_book(values, device) if torch.compiler.is_compiling() else cached(device)


def dequantize_absmax(q: NF4Rows) -> torch.Tensor:
    """fp32 ``[rows, blocks]`` absmax from its 8-bit codes, block scales and row offsets."""
    rows, blocks = q.absmax_code.shape
    code = _traceable(DYNAMIC_VALUES, dynamic_code, q.absmax_code.device)[q.absmax_code.long()]
    scale = q.absmax_scale.float().repeat_interleave(SCALE_BLOCK, dim=1)[:, :blocks]
    return code * scale + q.absmax_offset.float()[:, None]


def dequantize_nf4(q: NF4Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch reference: ``[rows, cols]`` in ``dtype`` (products in fp32, or fp64 for fp64,
    then rounded once, as bitsandbytes)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    rows, blocks = q.absmax_code.shape
    # Each byte's two codes, high nibble first, by a broadcast shift (a stack would be a copy of its own
    # in a compiled graph; this is one pointwise op that inductor fuses into the lookup below).
    shifts = torch.arange(4, -1, -4, device=q.packed.device)  # (4, 0)
    codes = ((q.packed.unsqueeze(-1) >> shifts) & 0xF).view(rows, blocks, BLOCK)
    values = _traceable(NF4_VALUES, nf4_code, q.packed.device).to(compute)[codes]
    w = values * dequantize_absmax(q).to(compute).unsqueeze(-1)
    return w.view(rows, blocks * BLOCK)[:, : q.cols].to(dtype)


# ----------------------------------------------------------------------------- dequantize + matmul


def _bnb_dequantize(q: NF4Rows, dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' CUDA dequantize (the flat layout equals ours when cols % 64 == 0)."""
    import bitsandbytes.functional as bnbf

    out = torch.empty(q.rows, q.cols, dtype=dtype, device=q.packed.device)
    return bnbf.dequantize_4bit(q.packed.view(-1, 1), absmax=dequantize_absmax(q), out=out, blocksize=BLOCK,
                                quant_type="nf4")


@functools.lru_cache(maxsize=None)
def bnb_available() -> bool:
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # ImportError, or a CUDA library it could not load
        return False
    return True


def resolve_nf4_backend(backend: str, device: torch.device, dtype: torch.dtype, q: NF4Rows) -> str:
    """The dequantization that runs for a matmul in ``dtype`` on ``device``."""
    if backend not in NF4_BACKENDS:
        raise ValueError(f"NF4 backend '{backend}' is not one of {', '.join(NF4_BACKENDS)}")
    if backend == "bnb":
        if not (device.type == "cuda" and q.cols % BLOCK == 0 and bnb_available()):
            raise ValueError("the 'bnb' NF4 backend needs CUDA tensors, bitsandbytes, and rows a multiple of 64")
        return "bnb"
    if backend == "torch":
        return "torch"
    # auto: Triton on CUDA (bench/bench_nf4.py: 2 TB/s, 1.6-2.3x bitsandbytes' dequantize), torch elsewhere and fp64
    return resolve_backend_for(backend, device, dtype)


def triton_dequantize(q: NF4Rows, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_nf4`` in one Triton launch (``galaxy.kernels.triton_nf4``)."""
    from galaxy.kernels.triton_nf4 import nf4_dequantize

    device = q.packed.device
    return nf4_dequantize(q.packed, q.absmax_code, q.absmax_scale, q.absmax_offset, q.cols, nf4_code(device),
                          dynamic_code(device), BLOCK, SCALE_BLOCK, dtype)


def _dequantize(q: NF4Rows, dtype: torch.dtype, backend: str) -> torch.Tensor:
    if backend == "triton":
        return triton_dequantize(q, dtype)
    return _bnb_dequantize(q, dtype) if backend == "bnb" else dequantize_nf4(q, dtype)


def nf4_linear(x: torch.Tensor, q: NF4Rows, bias: Optional[torch.Tensor] = None, transposed: bool = False,
               backend: str = "auto") -> torch.Tensor:
    """``x W^T + b`` with W stored in NF4 (``transposed``: stored as ``W^T``), computed in the
    autocast dtype when autocast is on, else in ``x``'s dtype. The weight gets no gradient."""
    if torch.compiler.is_compiling():
        # Inside a compiled layer the torch reference is traced and inductor fuses it (as the model's
        # other kernels: galaxy.models.base.use_triton); the eager kernels are calls dynamo cannot trace.
        return dequantized_linear(x, lambda dtype: dequantize_nf4(q, dtype), bias, transposed)
    device_type = x.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    chosen = resolve_nf4_backend(backend, x.device, compute, q)
    return dequantized_linear(x, lambda dtype: _dequantize(q, dtype, chosen), bias, transposed)


__all__ = ["BLOCK", "SCALE_BLOCK", "NF4_VALUES", "NF4Rows", "quantize_nf4", "dequantize_nf4", "dequantize_absmax",
           "dynamic_code", "nf4_linear"]
