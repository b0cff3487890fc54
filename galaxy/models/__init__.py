"""Model definitions (one folder per family: its module, its HF conversion, its family object), the
registry of families, and the factory the CLIs use.

``MODEL_FAMILIES`` maps each ``model_type`` to its family object (``galaxy.models.family.Family``): one
line per family. Code outside this package asks the family (``family(model_type)``: its tasks and classes,
whether it is causal, its probes, parameter counts, PEFT targets, side network, HF conversion) instead of
asking which model it is. ``check_config`` checks what only the families know (``galaxy.config`` stays
beneath them and checks the rest).
"""

from __future__ import annotations

from typing import Optional

from galaxy.config import COMPUTE_KEYS, ConfigError, GalaxyConfig, ModelConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.models.base import GalaxyModel
from galaxy.models.bert import BERT
from galaxy.models.family import Family
from galaxy.models.llama import LLAMA
from galaxy.models.phi3 import PHI3
from galaxy.models.qwen2 import QWEN2

MODEL_FAMILIES: dict[str, Family] = {
    "bert": BERT,
    "llama": LLAMA,
    "qwen2": QWEN2,
    "phi3": PHI3,
}


def family(model_type: str) -> Family:
    """The family of ``model_type`` (the object that states what the family is)."""
    if model_type not in MODEL_FAMILIES:
        raise ConfigError(f"config key 'model_type': unknown model '{model_type}'; use one of "
                          f"{', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type]


def family_of(model: GalaxyModel) -> Family:
    """The family of a built model."""
    return family(model.config.model_type)


def check_config(cfg: ModelConfig) -> None:
    """The model keys only the families can check: a known ``model_type``, and options its architecture has."""
    family(cfg.model_type).check(cfg)


def model_types(causal: Optional[bool] = None) -> list[str]:
    """Every known model_type (``causal``: only those whose LM is / is not causal)."""
    return [t for t, f in MODEL_FAMILIES.items() if causal is None or f.causal == causal]


def model_class(model_type: str, task: str = "lm") -> type[GalaxyModel]:
    """``task``: 'lm' (the family's language model, masked or causal) or 'classify'."""
    return family(model_type).for_task(task)


def model_class_named(name: str) -> type[GalaxyModel]:
    """The model class called ``name`` (as a checkpoint records it), of any family and task."""
    classes = {c.__name__: c for f in MODEL_FAMILIES.values() for c in f.classes.values()}
    if name not in classes:
        raise ValueError(f"unknown model class '{name}'; known: {', '.join(classes)}")
    return classes[name]


def hf_model_class(hf: dict, source: str) -> type[GalaxyModel]:
    """The causal-or-masked LM class that reads a HF ``config.json`` (``hf``) from ``source``."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise ConfigError(f"{source} holds a '{model_type}' model; supported model types: "
                          f"{', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type].lm


def build_model(cfg: GalaxyConfig, plan: Optional[Plan], ctx: ParallelContext, task: str = "lm"):
    """A fresh seeded model, or the local checkpoint ``data.model_path``, laid out by ``plan``."""
    check_config(cfg.model)
    cls = model_class(cfg.model.model_type, task)
    if cfg.data.model_path:
        # The checkpoint fixes the architecture; how it computes is still this config's choice.
        compute = {k: getattr(cfg.model, k) for k in COMPUTE_KEYS}
        return cls.from_pretrained(cfg.data.model_path, plan=plan, ctx=ctx, config_overrides=compute)
    return cls(cfg.model, plan, ctx, seed=cfg.train.seed)
