"""What every PEFT method shares: target matching by module name (HF PEFT's rules), seeded
plan-independent init of new parameters, freezing, and parameter counts in full (unsharded) sizes."""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn

from galaxy.core.context import param_seed
from galaxy.core.layers import shard_spec
from galaxy.loralib.quantized_layers import QuantizedWeight

Targets = Union[str, Sequence[str]]
InitFull = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


def matches(name: str, targets: Targets) -> bool:
    """HF PEFT's rule: a string is a regex that must match the whole module name; a list matches
    a module whose name equals an entry or ends with ``"." + entry``."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def parent_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(parent module, attribute name) of the submodule called ``name``."""
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(param)
    return spec.full_shape(param.shape) if spec else tuple(param.shape)


@torch.no_grad()
def seeded_init_(named: Iterable[tuple[str, nn.Parameter]], seed: int, init_full: InitFull) -> None:
    """Each full tensor is drawn from a generator seeded by (seed, full parameter name) and then
    sliced to this rank's shard, as ``GalaxyModel.init_weights`` does: every plan starts from the
    serial model's values."""
    for name, param in named:
        spec = shard_spec(param)
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        full = init_full(name, full_shape(param), gen).to(param.dtype)
        param.copy_((spec.slice(full) if spec else full).to(param.device))


def kaiming_uniform_full(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """``nn.init.kaiming_uniform_(a=sqrt(5))`` (nn.Linear's and HF PEFT's lora_A init) on the full tensor."""
    return nn.init.kaiming_uniform_(torch.empty(shape), a=5 ** 0.5, generator=gen)


def freeze_all_but(model: nn.Module, keep: Callable[[str, nn.Parameter], bool]) -> list[str]:
    """``requires_grad`` only for the parameters ``keep`` accepts; returns their names."""
    kept = []
    for name, p in model.named_parameters():
        p.requires_grad_(bool(keep(name, p)))
        if p.requires_grad:
            kept.append(name)
    return kept


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) in full sizes, so the numbers do not depend on the plan. Shared
    (tied) parameters count once; quantized weights (buffers) count as the frozen weights they are."""

    trainable, total = 0, sum(m.full_numel() for m in model.modules() if isinstance(m, QuantizedWeight) and not m.COPY)
    for p in model.parameters():  # parameters() yields each shared Parameter once
        n = 1
        for d in full_shape(p):
            n *= d
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def trainable_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of trainable weights made beside a base stored in ``dtype``: fp32 masters over a bf16/fp16
    base (which may arrive stored small, ``galaxy.loralib.quantized.materialize``); fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def to_trainable_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` in ``weight``'s dtype when autocast is off and they differ: fp32 trainable weights on a
    bf16/fp16 base's activations outside autocast (e.g. generation), as PEFT casts. Under autocast
    the matmul casts both to the autocast dtype anyway, so nothing is done."""
    if x.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(weight.dtype)


def in_modules(param_name: str, targets: Optional[Targets]) -> bool:
    """Whether a parameter lives in (or under) a module that ``targets`` names (PEFT's
    ``modules_to_save`` matching: 'classifier' keeps ``classifier.weight`` and ``classifier.bias``)."""
    if not targets:
        return False
    parts = param_name.split(".")[:-1]
    return any(matches(".".join(parts[:i]), targets) for i in range(1, len(parts) + 1))
