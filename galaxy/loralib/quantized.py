"""Frozen base weights stored small: in the compute dtype (bf16/fp16), or in NF4 (QLoRA).

``cast_frozen_`` moves every frozen floating-point parameter to the compute dtype in place (the
Parameter objects, and so their gradient rules and shard specs, stay). ``quantize_linears``
replaces the frozen linears by ``QuantLinear``s whose weight is an ``NF4Weight`` (buffers, no
Parameter), quantized from this rank's shard alone.

Why every plan equals serial QLoRA: NF4 blocks run along one row of the stored matrix
(``galaxy.kernels.nf4``), and a linear is stored so that tensor parallelism splits whole rows:
a column-parallel linear (q/k/v, gate/up, BERT query/key/value/intermediate) as ``W [out, in]``
(TP splits ``out``), a row-parallel one (o_proj, down_proj, BERT ``output.dense``) as
``W^T [in, out]`` (TP splits ``in``). The orientation belongs to the linear's TP form, not to the
plan, so a whole weight under SP or serial is stored the same way and the shards of every plan
are slices of the serial buffers, bit for bit. ``NF4Weight.spec`` records that slice (dim 0 of
every buffer), which is what gathering, checkpoints and resharding read.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn

from galaxy.core.layers import GradRule, ParallelLinear, ShardSpec, grad_rule, set_param_meta, shard_spec
from galaxy.kernels.nf4 import NF4Rows, dequantize_nf4, nf4_linear, quantize_nf4

logger = logging.getLogger(__name__)

# Linears whose TP form is row-parallel (the input dim is split): stored transposed.
ROW_PARALLEL_SUFFIXES = ("o_proj", "down_proj", "output.dense")
# Never quantized (QLoRA and bitsandbytes keep the output head in full precision).
KEEP_HEADS = ("lm_head", "classifier")
NF4_BUFFERS = ("packed", "absmax_code", "absmax_scale", "absmax_offset")


def row_parallel_name(name: str) -> bool:
    return any(name == s or name.endswith("." + s) for s in ROW_PARALLEL_SUFFIXES)


class NF4Weight(nn.Module):
    """A frozen weight ``[out, in]`` (this rank's piece) in NF4: ``packed`` uint8, ``absmax_code``
    uint8, ``absmax_scale`` fp32, ``absmax_offset`` fp32 buffers, one row of each per stored row.
    ``transposed``: stored as ``W^T``. ``spec``: the piece of the full buffers this rank holds
    (dim 0), or None when whole. ``backend``: the NF4 matmul (``galaxy.kernels.nf4.nf4_linear``)."""

    def __init__(self, q: NF4Rows, transposed: bool, spec: Optional[ShardSpec], backend: str = "auto"):
        super().__init__()
        for name in NF4_BUFFERS:
            self.register_buffer(name, getattr(q, name))
        self.cols, self.transposed, self.spec, self.backend = q.cols, transposed, spec, backend

    @classmethod
    def from_weight(cls, weight: torch.Tensor, transposed: bool, backend: str = "auto") -> "NF4Weight":
        """Quantize this rank's ``weight`` (a Parameter with Galaxy's shard metadata)."""
        spec = shard_spec(weight)
        if spec is not None and spec.dim != (1 if transposed else 0):
            raise ValueError(f"an NF4 weight stored {'transposed' if transposed else 'as [out, in]'} must be sharded "
                             f"along its rows, but the shard is along weight dim {spec.dim}")
        rows_spec = ShardSpec(0, spec.sizes, spec.rank) if spec is not None else None
        w = weight.detach()
        return cls(quantize_nf4(w.t() if transposed else w), transposed, rows_spec, backend)

    def rows(self) -> NF4Rows:
        return NF4Rows(self.packed, self.absmax_code, self.absmax_scale, self.absmax_offset, self.cols)

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's local ``[out, in]``."""
        r, c = self.packed.shape[0], self.cols
        return (c, r) if self.transposed else (r, c)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` (local) in ``dtype``."""
        w = dequantize_nf4(self.rows(), dtype)
        return w.t().contiguous() if self.transposed else w

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return nf4_linear(x, self.rows(), bias, self.transposed, self.backend)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        return f"shape={self.shape}, transposed={self.transposed}, backend={self.backend}"


class QuantLinear(nn.Module):
    """A frozen ``ParallelLinear`` whose weight is an ``NF4Weight``: same style, rank and bias
    (a Parameter, so ``lora_bias`` can still train it), same output."""

    def __init__(self, qweight: NF4Weight, bias: Optional[nn.Parameter], style: str, rank: int,
                 weight_spec: Optional[ShardSpec], weight_rule: GradRule):
        super().__init__()
        self.qweight, self.bias, self.style, self.rank = qweight, bias, style, rank
        self.weight_spec, self.weight_rule = weight_spec, weight_rule  # what the fp weight's metadata was

    @classmethod
    def from_linear(cls, linear: nn.Module, transposed: bool, backend: str = "auto") -> "QuantLinear":
        w = linear.weight
        return cls(NF4Weight.from_weight(w, transposed, backend), linear.bias, getattr(linear, "style", "whole"),
                   getattr(linear, "rank", 0), shard_spec(w), grad_rule(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qweight.linear(x, self.bias if (self.style != "row" or self.rank == 0) else None)

    def to_linear(self, dtype: torch.dtype = torch.float32) -> ParallelLinear:
        """The equivalent ``ParallelLinear`` with the dequantized weight (for merging and export)."""
        out_f, in_f = self.qweight.shape
        spec = self.weight_spec
        full = list(self.qweight.shape)
        if spec is not None:
            full[spec.dim] = sum(spec.sizes)
        split = spec.sizes if spec is not None else None
        linear = ParallelLinear(full[1], full[0], self.bias is not None, self.style, split, self.rank,
                                rule=self.weight_rule, device=self.qweight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.qweight.dequantize(dtype))
        if self.bias is not None:
            linear.bias = self.bias  # the same Parameter, metadata and all
        set_param_meta(linear.weight, self.weight_rule, spec)
        return linear

    def extra_repr(self) -> str:
        return f"style={self.style}, bias={self.bias is not None}"


def quantize_linears(model: nn.Module, skip=(), backend: str = "auto") -> list[str]:
    """Replace every ``ParallelLinear`` / ``nn.Linear`` of ``model`` (not under ``skip`` module
    names nor an output head) by a ``QuantLinear`` quantized from this rank's weight; returns the names."""
    from galaxy.loralib.utils import in_modules, parent_of

    done = []
    for name, module in list(model.named_modules()):
        if type(module) not in (ParallelLinear, nn.Linear) or in_modules(f"{name}.weight", list(skip) + list(KEEP_HEADS)):
            continue
        parent, child = parent_of(model, name)
        setattr(parent, child, QuantLinear.from_linear(module, row_parallel_name(name), backend))
        done.append(name)
    logger.info("NF4: quantized %d linears (e.g. %s)", len(done), done[:3])
    return done


def dequantize_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[str]:
    """Undo ``quantize_linears`` (to the dequantized values, in ``dtype``): every ``QuantLinear``
    becomes a ``ParallelLinear`` and every quantized LoRA layer gets its ``weight`` back."""
    from galaxy.loralib.layers import LoRALinear
    from galaxy.loralib.utils import parent_of

    done = []
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            parent, child = parent_of(model, name)
            setattr(parent, child, module.to_linear(dtype))
            done.append(name)
        elif isinstance(module, LoRALinear) and module.quantized:
            module.dequantize_base(dtype)
            done.append(name)
    return done


@torch.no_grad()
def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating-point parameter in ``dtype`` (in place); returns how many."""
    n = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n


def frozen_storage(model: nn.Module) -> tuple[int, int]:
    """(bytes, logical parameters) of this rank's frozen base weights: frozen parameters and NF4
    weights (every buffer they hold: codes and scales)."""
    nbytes = count = 0
    for p in model.parameters():
        if not p.requires_grad:
            nbytes += p.numel() * p.element_size()
            count += p.numel()
    for m in model.modules():
        if isinstance(m, NF4Weight):
            nbytes += m.nbytes()
            count += m.shape[0] * m.shape[1]
    return nbytes, count


__all__ = ["NF4Weight", "QuantLinear", "quantize_linears", "dequantize_linears", "cast_frozen_", "frozen_storage",
           "row_parallel_name"]
