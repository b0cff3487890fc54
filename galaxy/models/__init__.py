"""Model definitions (one per architecture) and the factory the CLIs use."""

from __future__ import annotations

from typing import Optional

from galaxy.config import COMPUTE_KEYS, GalaxyConfig, Plan
from galaxy.core.context import ParallelContext


def model_class(model_type: str, task: str = "lm"):
    """``task``: 'lm' (masked LM for BERT, causal LM for LLaMA) or 'classify' (BERT)."""
    if model_type == "bert":
        from galaxy.models.bert import BertForMaskedLM, BertForSequenceClassification

        return BertForSequenceClassification if task == "classify" else BertForMaskedLM
    if model_type == "llama":
        if task != "lm":
            raise ValueError(f"LLaMA has no '{task}' head; use task 'lm'")
        from galaxy.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise ValueError(f"unknown model_type '{model_type}'; use bert or llama")


def build_model(cfg: GalaxyConfig, plan: Optional[Plan], ctx: ParallelContext, task: str = "lm"):
    """A fresh seeded model, or the local checkpoint ``data.model_path``, laid out by ``plan``."""
    cls = model_class(cfg.model.model_type, task)
    if cfg.data.model_path:
        # The checkpoint fixes the architecture; how it computes is still this config's choice.
        compute = {k: getattr(cfg.model, k) for k in COMPUTE_KEYS}
        return cls.from_pretrained(cfg.data.model_path, plan=plan, ctx=ctx, config_overrides=compute)
    return cls(cfg.model, plan, ctx, seed=cfg.train.seed)
