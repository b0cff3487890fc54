"""Parallel building blocks: linears that are whole or sharded, dropout with an explicit stream,
and the per-parameter metadata (gradient rule, shard spec) that gradient sync and checkpoints read.

Gradient rules (docs/design.md section 1):
  SHARDED     a TP shard; its gradient is complete on its rank, no sync.
  PARTIAL     replicated value, but each rank saw only part of the work (weights used on sequence
              shards, a row-parallel bias added on one rank): gradients are summed over the group.
  REPLICATED  every rank did the same work and holds the same gradient: no sync.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.config import Method


class GradRule(str, enum.Enum):
    SHARDED = "sharded"
    PARTIAL = "partial"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds ``sizes[rank]`` slices of the full tensor along ``dim``."""

    dim: int
    sizes: tuple[int, ...]
    rank: int

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(self.sizes)
        return tuple(shape)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.offset, self.sizes[self.rank])


_RULE_ATTR = "_galaxy_grad_rule"
_SHARD_ATTR = "_galaxy_shard"


def set_param_meta(param: nn.Parameter, rule: GradRule, shard: Optional[ShardSpec] = None) -> None:
    setattr(param, _RULE_ATTR, rule)
    setattr(param, _SHARD_ATTR, shard)


def grad_rule(param: torch.Tensor) -> GradRule:
    return getattr(param, _RULE_ATTR, GradRule.REPLICATED)


def shard_spec(param: torch.Tensor) -> Optional[ShardSpec]:
    return getattr(param, _SHARD_ATTR, None)


def mark_module(module: nn.Module, rule: GradRule) -> nn.Module:
    """Tag every parameter of ``module`` that has no rule yet (e.g. a LayerNorm in a CON block)."""
    for p in module.parameters():
        if not hasattr(p, _RULE_ATTR):
            set_param_meta(p, rule)
    return module


def region_rule(method: Method) -> GradRule:
    """Rule of whole (unsharded) weights used by a block running ``method``."""
    return GradRule.PARTIAL if method == Method.SP else GradRule.REPLICATED


class ParallelLinear(nn.Module):
    """``y = x W^T + b`` with W whole, split by rows (column-parallel) or by columns (row-parallel).

    style="column": W is ``[out_split[rank], in]``; the output is sharded over features.
    style="row":    W is ``[out, in_split[rank]]``; the output is partial (layout P). The bias is
                    added on rank 0 only, so it is added once; its gradient rule is PARTIAL.
    style="whole":  W is ``[out, in]`` with gradient rule ``rule`` (PARTIAL under SP, else REPLICATED).
    Parameter names are ``weight`` and ``bias`` as in ``nn.Linear``, so HF names carry over.
    ``tp_form``: how tensor parallelism splits this linear ('column' / 'row'), also while it is whole
    (a block running SP or None), or None for a linear TP never splits (a head); a frozen base is
    stored by it (``galaxy.loralib.quantized``).
    ``float8``: None, or the float8 matmul the product runs through (``galaxy.core.float8``, config key
    ``float8_training``), on these same Parameters.
    """

    float8 = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, style: str = "whole",
                 split: Optional[Sequence[int]] = None, rank: int = 0,
                 rule: GradRule = GradRule.REPLICATED, device=None, dtype=None, tp_form: Optional[str] = None):
        super().__init__()
        self.style, self.rank = style, rank
        self.tp_form = style if style in ("column", "row") else tp_form
        kw = dict(device=device, dtype=dtype)
        if style == "column":
            spec = ShardSpec(0, tuple(split), rank)
            self.weight = nn.Parameter(torch.empty(split[rank], in_features, **kw))
            set_param_meta(self.weight, GradRule.SHARDED, spec)
            self.bias = nn.Parameter(torch.empty(split[rank], **kw)) if bias else None
            if bias:
                set_param_meta(self.bias, GradRule.SHARDED, spec)
        elif style == "row":
            self.weight = nn.Parameter(torch.empty(out_features, split[rank], **kw))
            set_param_meta(self.weight, GradRule.SHARDED, ShardSpec(1, tuple(split), rank))
            self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
            if bias:
                set_param_meta(self.bias, GradRule.PARTIAL)
        elif style == "whole":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
            self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
            for p in (self.weight, self.bias):
                if p is not None:
                    set_param_meta(p, rule)
        else:
            raise ValueError(f"unknown linear style '{style}'")

    @classmethod
    def for_method(cls, method: Method, in_features: int, out_features: int, bias: bool, shard: str,
                   split: Sequence[int], rank: int, **kw) -> "ParallelLinear":
        """The linear a block running ``method`` needs; ``shard`` ('column'/'row') is its TP form."""
        if method == Method.TP:
            return cls(in_features, out_features, bias, shard, split, rank, **kw)
        return cls(in_features, out_features, bias, "whole", rule=region_rule(method), tp_form=shard, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if (self.style != "row" or self.rank == 0) else None
        if self.float8 is not None:
            return self.float8(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        float8 = f", {self.float8}" if self.float8 is not None else ""
        return f"style={self.style}, weight={tuple(self.weight.shape)}, bias={self.bias is not None}{float8}"


class StackedLinear(nn.Module):
    """``parts`` linears sharing one input (a gated MLP's gate and up; the q/k/v heads of each key/value
    group), held as one weight ``[parts, *out_shape, in]`` and computed as one matmul whose output is the
    parts side by side (``[..., parts * prod(out_shape)]``). Column-parallel under TP along ``shard_dim``
    (1: every rank holds the same ``split[rank]`` rows of each part; 0: ``split[rank]`` whole parts), a
    slice of one dim, so a checkpoint stores the full tensor like any sharded parameter. No bias."""

    bias = None
    tp_form = "column"

    def __init__(self, parts: int, in_features: int, out_shape, style: str = "whole",
                 split: Optional[Sequence[int]] = None, rank: int = 0, rule: GradRule = GradRule.REPLICATED,
                 shard_dim: int = 1):
        super().__init__()
        self.style, self.rank = style, rank
        shape = [parts, *((out_shape,) if isinstance(out_shape, int) else out_shape), in_features]
        if style == "column":
            shape[shard_dim] = split[rank]
            self.weight = nn.Parameter(torch.empty(shape))
            set_param_meta(self.weight, GradRule.SHARDED, ShardSpec(shard_dim, tuple(split), rank))
        elif style == "whole":
            self.weight = nn.Parameter(torch.empty(shape))
            set_param_meta(self.weight, rule)
        else:
            raise ValueError(f"a stacked linear is column-parallel or whole, not '{style}'")

    @classmethod
    def for_method(cls, method: Method, parts: int, in_features: int, out_shape, split: Sequence[int], rank: int,
                   shard_dim: int = 1) -> "StackedLinear":
        if method == Method.TP:
            return cls(parts, in_features, out_shape, "column", split, rank, shard_dim=shard_dim)
        return cls(parts, in_features, out_shape, rule=region_rule(method))

    def matrix(self) -> torch.Tensor:
        """The weight as one column-parallel linear's ``[local rows, in]`` (a view)."""
        return self.weight.view(-1, self.weight.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.matrix())

    def extra_repr(self) -> str:
        return f"style={self.style}, weight={tuple(self.weight.shape)}"


@contextlib.contextmanager
def drawing_from(generator: Optional[torch.Generator]):
    """Run ops that only draw from the device's default RNG (``F.dropout``, the dropout inside
    ``scaled_dot_product_attention``) on ``generator``'s stream instead: its state is swapped into
    the default generator for the block and read back after, the default's own state restored.
    This keeps the fused one-kernel dropouts (bool masks, flash attention with dropout) while the
    streams stay explicit (the same on every rank in replicated regions, per rank in sharded ones)."""
    if generator is None:
        yield
        return
    device = generator.device
    if device.type == "cuda":
        default = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    else:
        default = torch.default_generator
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(default.get_state())
        default.set_state(saved)


class Dropout(nn.Module):
    """Dropout drawing its mask from an explicit generator, so replicated regions draw the same
    mask on every rank and sharded regions draw independent ones (see ``drawing_from``)."""

    def __init__(self, p: float, generator: Optional[torch.Generator] = None):
        super().__init__()
        self.p = p
        self.generator = generator

    @property
    def active(self) -> bool:
        return self.training and self.p > 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        with drawing_from(self.generator):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"
