"""LoRA on a whole model, by target-module name as in HF PEFT: injection, seeded init, freezing,
state dicts, merge / unmerge / unload, and CCLoRA fusion (``set_lora_fusion``)."""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn

from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import GradRule, ParallelLinear, grad_rule
from galaxy.loralib.layers import LORA_TYPES, LoRAEmbedding, LoRALayer, LoRALinear, MergedLoRALinear
from galaxy.loralib.quantized_layers import QuantLinear
from galaxy.loralib.utils import (Targets, freeze_all_but, in_modules, kaiming_uniform_full, matches, parent_of,
                                  seeded_init_)

logger = logging.getLogger(__name__)

BIAS_MODES = ("none", "all", "lora_only")


def _dropout_generator(model: nn.Module, base: nn.Module) -> Optional[torch.Generator]:
    """The dropout stream of the branch input's region: a column-parallel or replicated input is
    identical on every rank, so its mask must be too (x A^T is summed over B's shards); a
    row-parallel input (feature shard) or a sequence shard takes the per-rank stream."""
    ctx = getattr(model, "ctx", None)
    if ctx is None:
        return None
    style = getattr(base, "style", "whole")
    rule = base.weight_rule if isinstance(base, QuantLinear) else grad_rule(base.weight)
    sharded = style == "row" or (style == "whole" and rule == GradRule.PARTIAL)
    return ctx.generator(sharded=sharded)


def inject_lora(model: nn.Module, targets: Targets, r: int = 8, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
                fan_in_fan_out: bool = False, merge_weights: bool = False, use_rslora: bool = False,
                seed: int = 0, init_b_std: float = 0.0, merged: Optional[dict[str, dict]] = None,
                fusion: bool = False) -> list[str]:
    """Replace every module whose name matches ``targets`` by its LoRA form; returns their names.

    Linear modules (``ParallelLinear`` of any style, ``nn.Linear``) get ``LoRALinear``, embeddings
    ``LoRAEmbedding``; ``merged={name: dict(parts=..., enable_lora=..., part_splits=...)}`` makes
    the named fused linears ``MergedLoRALinear``. New weights are seeded from (seed, name) and
    sliced to the shard (``init_lora_weights``), so every plan starts from the serial values.
    ``fusion``: CCLoRA on (``set_lora_fusion``).
    """
    merged = merged or {}
    names = lora_target_names(model, targets)
    if not names:
        linears = [n for n, m in model.named_modules() if isinstance(m, (ParallelLinear, nn.Linear, QuantLinear))]
        raise ValueError(f"lora_target_modules {targets!r} match no module; linear modules are e.g. "
                         f"{linears[:6]}")
    created = []
    for name in names:
        parent, child = parent_of(model, name)
        base = getattr(parent, child)
        gen = _dropout_generator(model, base)
        opts = dict(lora_alpha=lora_alpha, lora_dropout=lora_dropout, merge_weights=merge_weights,
                    use_rslora=use_rslora, dropout_generator=gen)
        if name in merged:
            layer = MergedLoRALinear(base, r=r, **merged[name], **opts)
        elif isinstance(base, (ParallelLinear, nn.Linear, QuantLinear)):
            layer = LoRALinear(base, r, fan_in_fan_out=fan_in_fan_out, **opts)
        elif isinstance(base, nn.Embedding):
            layer = LoRAEmbedding(base, r, **opts)
        else:
            raise ValueError(f"LoRA target '{name}' is a {type(base).__name__}; LoRA applies to linear and "
                             "embedding modules (name a linear, e.g. 'query' or 'attention.output.dense')")
        setattr(parent, child, layer)
        created.append(name)
    init_lora_weights(model, seed, init_b_std, only=created)
    logger.info("LoRA r=%d alpha=%g on %d modules: %s", r, lora_alpha, len(created), created[:4])
    if fusion:
        set_lora_fusion(model, True)
    return created


def lora_target_names(model: nn.Module, targets: Targets) -> list[str]:
    """The modules ``inject_lora`` wraps for ``targets`` (none inside a LoRA layer already there)."""
    inside = tuple(n + "." for n in lora_modules(model))  # a LoRA layer's own A/B are never targets
    return [n for n, m in model.named_modules()
            if n and matches(n, targets) and not isinstance(m, LORA_TYPES) and not n.startswith(inside)]


def set_lora_fusion(model: nn.Module, enabled: bool = True) -> list[str]:
    """CCLoRA (``galaxy.core.overlap.cclora``, config key ``lora_fusion``) on or off for every LoRA
    linear of ``model``; returns their names. The parameters are untouched (A stays HF PEFT's
    unscaled A), so it can be switched at any time and saved files do not change.

    A Galaxy model picks its block edges again (``GalaxyModel.parallelize``), so the TP block edges that
    have a LoRA linear overlap its branch with their collectives; edges without one keep CoC as
    configured (``coc_parallel_num``)."""
    layers = {n: m for n, m in lora_modules(model).items() if isinstance(m, (LoRALinear, MergedLoRALinear))}
    for m in layers.values():
        m.fusion = enabled
    parallelize = getattr(model, "parallelize", None)
    if callable(parallelize):
        parallelize(lora_fusion=enabled)
    logger.info("LoRA fusion (CCLoRA) %s on %d linears", "on" if enabled else "off", len(layers))
    return sorted(layers)


def init_lora_weights(model: nn.Module, seed: int, init_b_std: float = 0.0, only: Optional[list[str]] = None) -> None:
    """HF PEFT's init, plan-independent: linear A kaiming-uniform(a=sqrt(5)), B zeros; embedding
    A zeros, B normal. ``init_b_std > 0`` draws the zero-initialised factor from N(0, std) instead,
    so tests see a non-trivial branch and non-zero gradients on both factors."""

    def init_full(name: str, shape, gen):
        if name.endswith("lora_A.weight"):
            return kaiming_uniform_full(shape, gen)
        if name.endswith("lora_embedding_B"):
            return torch.randn(shape, generator=gen)
        if init_b_std > 0:
            return torch.randn(shape, generator=gen) * init_b_std
        return torch.zeros(shape)

    named = []
    for mod_name, module in model.named_modules():
        if isinstance(module, LORA_TYPES) and (only is None or mod_name in only):
            named += [(f"{mod_name}.{n}", p) for n, p in module.named_parameters()
                      if n.startswith("lora_")]
    seeded_init_(named, seed, init_full)


def lora_modules(model: nn.Module) -> dict[str, LoRALayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LORA_TYPES)}


def is_lora_param(name: str) -> bool:
    return "lora_" in name


def mark_only_lora_as_trainable(model: nn.Module, bias: str = "none",
                                also: Optional[Targets] = None) -> list[str]:
    """Freeze everything but the LoRA factors (loralib's helper). ``bias``: 'none', 'all' (every
    bias trains) or 'lora_only' (biases of LoRA-wrapped modules). ``also``: module names (PEFT's
    ``modules_to_save``, e.g. a classifier head) that keep training. Returns the trainable names."""
    keep = lora_keeps(bias, also, lora_modules(model))
    return freeze_all_but(model, lambda name, _p: keep(name))


def lora_keeps(bias: str = "none", also: Optional[Targets] = None, wrapped=()):
    """``mark_only_lora_as_trainable``'s rule: whether parameter ``name`` trains, given the LoRA-wrapped
    module names ``wrapped`` (before injection: ``lora_target_names``, as a base is built frozen)."""
    if bias not in BIAS_MODES:
        raise ValueError(f"lora bias '{bias}' is not one of {', '.join(BIAS_MODES)}")
    wrapped = set(wrapped)

    def keep(name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        if is_lora_param(name):
            return True
        if leaf == "bias" and (bias == "all" or (bias == "lora_only" and module in wrapped)):
            return True
        return in_modules(name, also)

    return keep


def lora_state_dict(model: nn.Module, bias: str = "none", full: bool = False) -> dict[str, torch.Tensor]:
    """The LoRA factors (and biases per ``bias``), local shards or, with ``full``, whole tensors
    (then a collective over the model-parallel group: every rank must call it)."""
    wrapped = set(lora_modules(model))
    comm = getattr(getattr(model, "ctx", None), "mp", None)
    out = {}
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if is_lora_param(name) or (leaf == "bias" and (bias == "all" or (bias == "lora_only" and module in wrapped))):
            out[name] = gather_full(p.detach(), p, comm).cpu() if (full and comm is not None) else p.detach()
    return out


def _check_untied(model: nn.Module, layers: dict[str, LoRALayer]) -> None:
    # A tied weight (BERT's MLM decoder, a tied LLaMA lm_head) is read elsewhere too: merging
    # would move that reader by s*BA, which the unmerged model never does.
    tied = set(getattr(model, "tied_keys", {}) or {}) | set((getattr(model, "tied_keys", {}) or {}).values())
    bad = [n for n in layers if f"{n}.weight" in tied]
    if bad:
        raise ValueError(f"LoRA on {bad} cannot be merged: the weight is tied to another module, which would change "
                         "with it; keep it unmerged or leave tied embeddings out of lora_target_modules")


def merge_lora(model: nn.Module) -> None:
    layers = lora_modules(model)
    _check_untied(model, layers)
    for m in layers.values():
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge every LoRA layer into its base weight and put the original module back (PEFT's
    ``merge_and_unload``): the model is then the plain architecture again, e.g. for
    ``save_pretrained``. In place; returns ``model``."""
    layers = lora_modules(model)
    _check_untied(model, layers)
    for name, layer in layers.items():
        layer.merge()
        parent, child = parent_of(model, name)
        setattr(parent, child, layer.base_layer)
    return model


__all__ = ["inject_lora", "init_lora_weights", "lora_modules", "lora_target_names", "lora_keeps",
           "mark_only_lora_as_trainable", "lora_state_dict", "merge_lora", "unmerge_lora", "merge_and_unload",
           "set_lora_fusion", "LoRALinear", "MergedLoRALinear", "LoRAEmbedding"]
