"""LoRA layers over Galaxy's parallel linears, so every plan computes exactly the serial LoRA.

``y = x W^T + b + s * B(A(dropout(x)))`` with ``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).
Which factor is sharded follows the base linear's style (docs/design.md section 3):

  base style   A                                   B                                  why
  whole        whole, base rule                    whole, base rule                   same work as the base weight
  column       whole, PARTIAL                      column-sharded like W's rows       the input is replicated (T), so
                                                                                      x A^T is too; rank i's dA only
                                                                                      sees the gradient through B_i
  row          row-sharded like W's columns        whole, PARTIAL                     x_i A_i^T summed over ranks is
                                                                                      x A^T; the branch output is
                                                                                      partial like the base's, and
                                                                                      rank i's dB only sees x_i A_i^T

A and B are ``ParallelLinear``s themselves, so their metadata (rule, shard spec) is what the
gradient sync, ``gather_full`` and checkpoints already read. A LoRA layer takes over the base
module's ``weight``/``bias`` Parameters (same objects, same metadata), so the HF parameter names
of the model do not change (``...query.weight``) and the new ones read like HF PEFT's
(``...query.lora_A.weight``). Merging works per shard and is exact: column ``W_i += s B_i A``,
row ``W_i += s B A_i``.

``fusion`` (config key ``lora_fusion``, set by ``set_lora_fusion``) runs the layer through CCLoRA
(``galaxy.core.overlap.cclora``: scale folded into A, merged weight when the rows reach the input width
and no LoRA dropout is active, LoRA's exact gradients); ``cclora_operands()`` hands the same pieces
to the fused TP block edges.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.core.layers import Dropout, GradRule, ParallelLinear, ShardSpec, grad_rule, set_param_meta, shard_spec
from galaxy.core.overlap.cclora import LinearOperands, cclora_linear
from galaxy.loralib.quantized_layers import QuantLinear
from galaxy.loralib.utils import to_trainable_dtype

logger = logging.getLogger(__name__)


def _merge_dtype(dtype: torch.dtype) -> torch.dtype:
    # Merge in fp32 (fp64 stays fp64), then cast back: a bf16 W + s*BA rounded once, not per product.
    return torch.promote_types(dtype, torch.float32)


class LoRALayer(nn.Module):
    """What the LoRA layers share: scaling, dropout, merge state and ``merge_weights`` on eval."""

    def __init__(self, r: int, lora_alpha: float, lora_dropout: float, merge_weights: bool, use_rslora: bool,
                 dropout_generator: Optional[torch.Generator]):
        super().__init__()
        if r <= 0:
            raise ValueError(f"config key 'lora_dim' must be positive, got {r}")
        self.r, self.lora_alpha = r, lora_alpha
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout = Dropout(lora_dropout, dropout_generator) if lora_dropout > 0 else nn.Identity()
        self.merge_weights = merge_weights
        self.merged = False
        self.fusion = False  # CCLoRA; LoRALinear and MergedLoRALinear only
        # The original module, restored by ``merge_and_unload``; a tuple keeps it out of the module
        # tree (its parameters are ours already).
        self._base = ()

    @property
    def base_layer(self) -> nn.Module:
        return self._base[0]

    @property
    def active_dropout(self) -> Optional[Dropout]:
        """The dropout on the branch's input while it drops anything (training, p > 0), else None."""
        d = self.lora_dropout
        return d if isinstance(d, Dropout) and d.active else None

    def delta_weight(self) -> torch.Tensor:
        """``s * B A`` in this rank's local shape of ``weight``, in the merge dtype."""
        raise NotImplementedError

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        w = self.weight
        w.copy_((w.to(_merge_dtype(w.dtype)) + self.delta_weight()).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        w = self.weight
        w.copy_((w.to(_merge_dtype(w.dtype)) - self.delta_weight()).to(w.dtype))
        self.merged = False

    def train(self, mode: bool = True):
        # loralib's ``merge_weights``: eval runs on the merged weight (no extra matmuls),
        # training on the separate factors.
        super().train(mode)
        if self.merge_weights:
            self.unmerge() if mode else self.merge()
        return self


class _LinearLoRA(LoRALayer):
    """What every LoRA linear does with its ``base_forward`` and ``branch`` (the LoRA term before
    scaling): the CCLoRA kernel when fused, the base alone when merged, else base + scaled branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fusion and not self.merged:
            return cclora_linear(x, self.cclora_operands())
        y = self.base_forward(x)
        return y if self.merged else y + (self.branch(x) * self.scaling).to(y.dtype)


class LoRALinear(_LinearLoRA):
    """LoRA on a ``ParallelLinear`` (any style) or a plain ``nn.Linear`` (treated as whole).

    ``fan_in_fan_out``: the base weight is stored ``[in, out]`` (GPT-2 ``Conv1D`` style), whole only.
    """

    def __init__(self, base: nn.Module, r: int, lora_alpha: float = 1.0, lora_dropout: float = 0.0,
                 fan_in_fan_out: bool = False, merge_weights: bool = False, use_rslora: bool = False,
                 dropout_generator: Optional[torch.Generator] = None):
        super().__init__(r, lora_alpha, lora_dropout, merge_weights, use_rslora, dropout_generator)
        self._base = (base,)
        self.bias = base.bias
        self.style = getattr(base, "style", "whole")
        self.rank = getattr(base, "rank", 0)
        self.fan_in_fan_out = fan_in_fan_out
        if isinstance(base, QuantLinear):  # QLoRA: the base weight stays quantized (``qweight``), no ``weight``
            if fan_in_fan_out:
                raise ValueError("fan_in_fan_out applies to [in, out] weights, not to a quantized linear")
            self.qweight = base.qweight
            shape, spec, rule, device = base.qweight.shape, base.weight_spec, base.weight_rule, base.qweight.device
            dtype = torch.float32
        else:
            self.weight = base.weight
            w = base.weight
            shape, spec, rule, device = tuple(w.shape), shard_spec(w), grad_rule(w), w.device
            dtype = _merge_dtype(w.dtype)  # trainable factors keep fp32 masters over a bf16/fp16 base
        kw = dict(device=device, dtype=dtype)
        if fan_in_fan_out and self.style != "whole":
            raise ValueError("fan_in_fan_out applies to whole [in, out] weights (Conv1D style), not to a "
                             f"{self.style}-parallel linear")
        if self.style == "column":
            out_split, in_features = spec.sizes, shape[1]
            self.lora_A = ParallelLinear(in_features, r, False, "whole", rule=GradRule.PARTIAL, **kw)
            self.lora_B = ParallelLinear(r, sum(out_split), False, "column", out_split, spec.rank, **kw)
        elif self.style == "row":
            in_split, out_features = spec.sizes, shape[0]
            self.lora_A = ParallelLinear(sum(in_split), r, False, "row", in_split, spec.rank, **kw)
            self.lora_B = ParallelLinear(r, out_features, False, "whole", rule=GradRule.PARTIAL, **kw)
        elif self.style == "whole":
            in_features, out_features = (shape[0], shape[1]) if fan_in_fan_out else (shape[1], shape[0])
            self.lora_A = ParallelLinear(in_features, r, False, "whole", rule=rule, **kw)
            self.lora_B = ParallelLinear(r, out_features, False, "whole", rule=rule, **kw)
        else:
            raise ValueError(f"unknown linear style '{self.style}'")
        with torch.no_grad():  # output == base until seeded init (``init_lora_weights``) fills A
            self.lora_A.weight.zero_()
            self.lora_B.weight.zero_()

    @property
    def quantized(self) -> bool:
        return "qweight" in self._modules

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if (self.style != "row" or self.rank == 0) else None  # row bias added once
        if self.quantized:
            return self.qweight.linear(x, bias)
        w = self.weight.t() if self.fan_in_fan_out else self.weight
        return F.linear(x, w, bias)

    def dequantize_base(self, dtype: torch.dtype = torch.float32) -> None:
        """QLoRA -> LoRA on the dequantized base (``weight`` in ``dtype``), e.g. to merge and export."""
        linear = self.base_layer.to_linear(dtype)
        del self.qweight
        self.weight, self._base = linear.weight, (linear,)

    def merge(self) -> None:
        if self.quantized:
            raise ValueError("LoRA over a quantized base cannot be merged into it; dequantize the base first "
                             "(galaxy.loralib.quantized.dequantize_linears, as export_merged does)")
        super().merge()

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        # Row style: the branch is part of the partial sum, so every rank adds its own term.
        return self.lora_B(self.lora_A(to_trainable_dtype(self.lora_dropout(x), self.lora_A.weight)))

    def cclora_operands(self) -> Optional[LinearOperands]:
        """This rank's weight, bias and factors for CCLoRA; None while fusion is off."""
        if not self.fusion:
            return None
        if self.quantized:
            raise ValueError("LoRA fusion (CCLoRA) needs the base weight; it does not run over a quantized base")
        w = self.weight.t() if self.fan_in_fan_out else self.weight
        bias = self.bias if (self.style != "row" or self.rank == 0) else None
        if self.merged:
            return LinearOperands(w, bias)
        return LinearOperands(w, bias, self.lora_A.weight, self.lora_B.weight, self.scaling, self.active_dropout)

    def delta_weight(self) -> torch.Tensor:
        dt = _merge_dtype(self.weight.dtype)
        delta = (self.lora_B.weight.to(dt) @ self.lora_A.weight.to(dt)) * self.scaling
        return delta.t() if self.fan_in_fan_out else delta

    def extra_repr(self) -> str:
        shape = self.qweight.shape if self.quantized else tuple(self.weight.shape)
        fmt = f" {self.qweight.FORMAT}" if self.quantized else ""
        return f"style={self.style}, weight={shape}{fmt}, r={self.r}, " \
               f"scaling={self.scaling:g}, merged={self.merged}"


class MergedLoRALinear(_LinearLoRA):
    """LoRA on a fused linear whose output is the concatenation of ``parts`` (e.g. q, k, v), with
    LoRA on some parts only (``enable_lora=[True, False, True]``), as loralib's ``MergedLinear``.

    Styles: whole, or column-parallel where each part is split on its own (``part_splits[p]``, one
    size per rank) and rank i's weight rows are the concatenation of its share of every part.
    A (``[r * enabled, in]``) is whole; each enabled part has its own B (``lora_B.<j>``), sharded
    like that part, so ``gather_full`` rebuilds each B exactly.
    """

    def __init__(self, base: nn.Module, parts: Sequence[int], enable_lora: Sequence[bool], r: int,
                 lora_alpha: float = 1.0, lora_dropout: float = 0.0, merge_weights: bool = False,
                 part_splits: Optional[Sequence[Sequence[int]]] = None, use_rslora: bool = False,
                 dropout_generator: Optional[torch.Generator] = None):
        super().__init__(r, lora_alpha, lora_dropout, merge_weights, use_rslora, dropout_generator)
        if len(parts) != len(enable_lora) or not any(enable_lora):
            raise ValueError(f"enable_lora {list(enable_lora)} must have one flag per part {list(parts)}, "
                             "at least one of them set")
        self._base = (base,)
        self.weight, self.bias = base.weight, base.bias
        self.style = getattr(base, "style", "whole")
        self.rank = getattr(base, "rank", 0)
        self.enable_lora = tuple(bool(e) for e in enable_lora)
        w = base.weight
        kw = dict(device=w.device, dtype=w.dtype)
        if self.style == "column":
            spec = shard_spec(w)
            if part_splits is None or len(part_splits) != len(parts):
                raise ValueError("a column-parallel fused linear needs part_splits: one split (per rank) per part")
            if any(sum(s) != p for s, p in zip(part_splits, parts)):
                raise ValueError(f"part_splits {part_splits} do not add up to the parts {list(parts)}")
            self.local_parts = tuple(s[spec.rank] for s in part_splits)
            a_rule = GradRule.PARTIAL
        elif self.style == "whole":
            self.local_parts = tuple(parts)
            a_rule = grad_rule(w)
        else:
            raise ValueError(f"a fused linear is whole or column-parallel, not {self.style}")
        if sum(self.local_parts) != w.shape[0]:
            raise ValueError(f"the parts {self.local_parts} on this rank do not add up to the weight's "
                             f"{w.shape[0]} rows")
        kw["dtype"] = _merge_dtype(w.dtype)  # fp32 masters over a bf16/fp16 base
        enabled = sum(self.enable_lora)
        self.lora_A = ParallelLinear(w.shape[1], r * enabled, False, "whole", rule=a_rule, **kw)
        self.lora_B = nn.ModuleList()
        for p, size in enumerate(parts):
            if not self.enable_lora[p]:
                continue
            if self.style == "column":
                self.lora_B.append(ParallelLinear(r, size, False, "column", part_splits[p], spec.rank, **kw))
            else:
                self.lora_B.append(ParallelLinear(r, size, False, "whole", rule=a_rule, **kw))
        with torch.no_grad():
            self.lora_A.weight.zero_()
            for b in self.lora_B:
                b.weight.zero_()

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        h = to_trainable_dtype(self.lora_dropout(x), self.lora_A.weight)
        chunks = iter(self.lora_A(h).split(self.r, dim=-1))
        heads = iter(self.lora_B)
        pieces = [next(heads)(next(chunks)) if on else h.new_zeros(*x.shape[:-1], n)
                  for on, n in zip(self.enable_lora, self.local_parts)]
        return torch.cat(pieces, dim=-1)

    def cclora_operands(self) -> Optional[LinearOperands]:
        """As ``LoRALinear.cclora_operands``, with the parts' B stacked into one block matrix."""
        if not self.fusion:
            return None
        if self.merged:
            return LinearOperands(self.weight, self.bias)
        return LinearOperands(self.weight, self.bias, self.lora_A.weight, self.stacked_b(), self.scaling,
                              self.active_dropout)

    def stacked_b(self) -> torch.Tensor:
        """The parts' B as one ``[out_local, r * enabled]`` matrix: part p's rows hold its B in its
        own r columns of A's rows (zeros for parts without LoRA), so ``stacked_b() @ A`` is
        ``delta_weight() / scaling``. Built with autograd ops: gradients flow back to each B."""
        enabled, blocks, heads = sum(self.enable_lora), [], iter(self.lora_B)
        j = 0
        for on, n in zip(self.enable_lora, self.local_parts):
            if on:
                blocks.append(F.pad(next(heads).weight, (j * self.r, (enabled - 1 - j) * self.r)))
                j += 1
            else:
                blocks.append(self.lora_A.weight.new_zeros(n, enabled * self.r))
        return torch.cat(blocks, dim=0)

    def delta_weight(self) -> torch.Tensor:
        dt = _merge_dtype(self.weight.dtype)
        a_parts = iter(self.lora_A.weight.to(dt).split(self.r, dim=0))
        heads = iter(self.lora_B)
        rows = [next(heads).weight.to(dt) @ next(a_parts) if on
                else torch.zeros(n, self.weight.shape[1], dtype=dt, device=self.weight.device)
                for on, n in zip(self.enable_lora, self.local_parts)]
        return torch.cat(rows, dim=0) * self.scaling

    def extra_repr(self) -> str:
        return f"style={self.style}, parts={self.local_parts}, enable_lora={list(self.enable_lora)}, r={self.r}"


class LoRAEmbedding(LoRALayer):
    """LoRA on an ``nn.Embedding`` (whole weight), in HF PEFT's layout: ``lora_embedding_A``
    ``[r, num_embeddings]`` and ``lora_embedding_B`` ``[dim, r]``; A starts at zero and B random,
    the reverse of the linear case, as in PEFT (a zero lookup table keeps the output unchanged)."""

    def __init__(self, base: nn.Embedding, r: int, lora_alpha: float = 1.0, lora_dropout: float = 0.0,
                 merge_weights: bool = False, use_rslora: bool = False,
                 dropout_generator: Optional[torch.Generator] = None):
        super().__init__(r, lora_alpha, lora_dropout, merge_weights, use_rslora, dropout_generator)
        if shard_spec(base.weight) is not None:
            raise ValueError("LoRA on a sharded embedding is not supported; Galaxy's embeddings are whole")
        self._base = (base,)
        self.weight = base.weight
        self.padding_idx, self.max_norm = base.padding_idx, base.max_norm
        self.norm_type, self.scale_grad_by_freq, self.sparse = base.norm_type, base.scale_grad_by_freq, base.sparse
        num, dim = base.weight.shape
        kw = dict(device=base.weight.device, dtype=_merge_dtype(base.weight.dtype))
        self.lora_embedding_A = nn.Parameter(torch.zeros(r, num, **kw))
        self.lora_embedding_B = nn.Parameter(torch.zeros(dim, r, **kw))
        rule = grad_rule(base.weight)
        set_param_meta(self.lora_embedding_A, rule)
        set_param_meta(self.lora_embedding_B, rule)

    def _embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self._embed(ids, self.weight)
        if self.merged:
            return y
        # Dropout on integer ids makes no sense; PEFT applies none on this path either.
        branch = self._embed(ids, self.lora_embedding_A.t()) @ self.lora_embedding_B.t()
        return y + (branch * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        dt = _merge_dtype(self.weight.dtype)
        return (self.lora_embedding_B.to(dt) @ self.lora_embedding_A.to(dt)).t() * self.scaling

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, r={self.r}, scaling={self.scaling:g}, merged={self.merged}"


LORA_TYPES = (LoRALinear, MergedLoRALinear, LoRAEmbedding)


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param`` (its shard, or all of it)."""
    spec: Optional[ShardSpec] = shard_spec(param)
    return spec.slice(full) if spec else full
