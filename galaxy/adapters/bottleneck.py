"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2021) living in the CON block's layout.

An adapter is ``x + up(act(down(x)))`` on a block's output just before the residual add. Those
outputs are in the residual stream's layout (CON's: sequence shards under CON.sp, replicated
otherwise), where a whole weight sees whole feature vectors, so the adapter is exact on every
plan: its weights are whole with rule ``region_rule(plan.con)`` (PARTIAL when each rank holds a
sequence shard, REPLICATED otherwise).

Injection points are module names (the modules are wrapped, as HF PEFT wraps its targets), which
each model family states as ``adapter_points`` (site -> regex): the outputs of ATT ('attn') and MLP ('mlp')
before their residual add, e.g. BERT's ``encoder.layer.N.attention.output.dropout`` and LLaMA's
``layers.N.mlp_dropout``.

Houlsby puts an adapter at both sites, Pfeiffer at 'mlp' only.
"""

from __future__ import annotations

import logging
import re
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.core.layers import GradRule, ParallelLinear, region_rule
from galaxy.loralib.utils import (freeze_all_but, in_modules, parent_of, seeded_init_, to_trainable_dtype,
                                  trainable_dtype)

logger = logging.getLogger(__name__)

NON_LINEARITIES = {"relu": F.relu, "gelu": F.gelu, "gelu_new": partial(F.gelu, approximate="tanh"),
                   "silu": F.silu, "swish": F.silu, "tanh": torch.tanh}
ADAPTER_SITES = {"houlsby": ("attn", "mlp"), "pfeiffer": ("mlp",)}


class BottleneckAdapter(nn.Module):
    """``x + up(act(down(x)))`` (``residual=False``: without the ``x +``). ``down``: hidden ->
    hidden // reduction_factor; ``up`` starts at zero so the adapted model starts as the base."""

    def __init__(self, hidden_size: int, reduction_factor: int = 16, non_linearity: str = "relu",
                 residual: bool = True, rule: GradRule = GradRule.REPLICATED, device=None, dtype=None):
        super().__init__()
        if non_linearity not in NON_LINEARITIES:
            raise ValueError(f"adapter non_linearity '{non_linearity}' is not one of {', '.join(NON_LINEARITIES)}")
        if reduction_factor <= 0:
            raise ValueError(f"adapter reduction_factor must be positive, got {reduction_factor}")
        bottleneck = max(1, hidden_size // reduction_factor)
        kw = dict(device=device, dtype=dtype)
        self.down = ParallelLinear(hidden_size, bottleneck, True, "whole", rule=rule, **kw)
        self.up = ParallelLinear(bottleneck, hidden_size, True, "whole", rule=rule, **kw)
        self.non_linearity, self.residual = non_linearity, residual
        self.act = NON_LINEARITIES[non_linearity]
        # A standalone adapter starts valid (ParallelLinear leaves its storage uninitialised);
        # add_adapters re-draws these per (seed, name) so every plan starts from the serial values.
        with torch.no_grad():
            nn.init.normal_(self.down.weight, std=0.02)
            for p in (self.down.bias, self.up.weight, self.up.bias):
                p.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(self.act(self.down(to_trainable_dtype(x, self.down.weight)))).to(x.dtype)
        return x + y if self.residual else y

    def extra_repr(self) -> str:
        return f"act={self.non_linearity}, residual={self.residual}"


class AdapterAfter(nn.Module):
    """``module`` followed by ``adapter`` (the wrapped module keeps its own parameters)."""

    def __init__(self, module: nn.Module, adapter: BottleneckAdapter):
        super().__init__()
        self.module, self.adapter = module, adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.module(x))


def _adapter_modules(model: nn.Module) -> dict[str, BottleneckAdapter]:
    return {n: m for n, m in model.named_modules() if isinstance(m, BottleneckAdapter)}


def add_adapters(model: nn.Module, kind: str = "houlsby", reduction_factor: int = 16, non_linearity: str = "relu",
                 residual: bool = True, seed: int = 0, init_up_std: float = 0.0,
                 points: Optional[dict[str, str]] = None) -> list[str]:
    """Insert bottleneck adapters into a Galaxy model (``model.config``, ``model.plan`` read);
    returns the adapter module names. ``points``: {site: module-name regex}, its family's
    ``adapter_points`` (``galaxy.peft`` passes them). Weights are seeded from (seed, name): down N(0, 0.02), up and
    biases zero (``init_up_std > 0``: up N(0, std), for tests that need a non-trivial adapter)."""
    if kind not in ADAPTER_SITES:
        raise ValueError(f"adapter kind '{kind}' is not one of {', '.join(ADAPTER_SITES)}")
    model_type = model.config.model_type
    if not points:
        raise ValueError(f"no adapter injection points known for model type '{model_type}'; pass points=")
    sites = ADAPTER_SITES[kind]
    rule = region_rule(model.plan.con)
    hidden = model.config.hidden_size
    w = next(model.parameters())
    make = partial(BottleneckAdapter, hidden, reduction_factor, non_linearity, residual, rule,
                   device=w.device, dtype=trainable_dtype(w.dtype))
    names = [n for n, _ in model.named_modules()]
    created: list[str] = []
    for site in sites:
        found = [n for n in names if re.fullmatch(points[site], n)]
        if not found:
            raise ValueError(f"no '{site}' adapter injection point ({points[site]}) in this {model_type} model")
        for name in found:
            parent, child = parent_of(model, name)
            setattr(parent, child, AdapterAfter(getattr(parent, child), make()))
            created.append(f"{name}.adapter")
    init_adapter_weights(model, seed, init_up_std, only=created)
    logger.info("%s adapters (reduction %d, %s) at %d points", kind, reduction_factor, non_linearity, len(created))
    return created


def init_adapter_weights(model: nn.Module, seed: int, init_up_std: float = 0.0,
                         only: Optional[list[str]] = None) -> None:
    def init_full(name: str, shape, gen):
        if name.endswith("down.weight"):
            return torch.randn(shape, generator=gen) * 0.02
        if name.endswith("up.weight") and init_up_std > 0:
            return torch.randn(shape, generator=gen) * init_up_std
        return torch.zeros(shape)

    named = [(f"{m}.{n}", p) for m, mod in _adapter_modules(model).items() if only is None or m in only
             for n, p in mod.named_parameters()]
    seeded_init_(named, seed, init_full)


def is_adapter_param(model: nn.Module):
    prefixes = tuple(n + "." for n in _adapter_modules(model))
    return lambda name, _p=None: name.startswith(prefixes)


def mark_only_adapters_as_trainable(model: nn.Module, also=None) -> list[str]:
    """Freeze all but the adapters (and the modules named in ``also``, e.g. a classifier)."""
    own = is_adapter_param(model)
    return freeze_all_but(model, lambda n, p: own(n) or in_modules(n, also))
