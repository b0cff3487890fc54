"""What a model family is, to the rest of the house: one object per family (``galaxy/models/<family>/``,
registered by ``model_type`` in ``galaxy.models``), apart from the modules that compute.

The planner, PEFT, training and the CLIs ask the family instead of asking which model it is: its tasks
and their classes, whether its LM is causal, its small config and named sizes, its default LoRA targets
and adapter sites, the shapes the planner's cost model reads and the block probes it times, its side
network's spec, its HF conversion and the model keys only it can check. ``isinstance(model, family)``
says whether a built model is one of the family's classes.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

from galaxy.config import ConfigError, ModelConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.models.base import GalaxyModel, LayerParameters


class Family:
    """A model family; subclasses state its facts and implement the shapes, probes and side spec."""

    classes: Mapping[str, type[GalaxyModel]] = {}  # task ('lm', 'classify') -> its model class
    causal = False  # its LM predicts the next token (else masked tokens): evaluation, generation, data
    rotary = False  # attention heads rotate by RoPE, so a head's size must be even
    tiny_config: Mapping = {}  # model keys of a small model of the family, where CLIs start without a config
    lora_targets: tuple[str, ...] = ()  # HF PEFT's default LoRA target modules for the architecture
    adapter_points: Mapping[str, str] = {}  # adapter site ('attn', 'mlp') -> module-name regex

    # -- the classes

    @property
    def tasks(self) -> tuple[str, ...]:
        """Heads the family has ('lm', 'classify'); ``for_task`` picks the class."""
        return tuple(self.classes)

    @property
    def lm(self) -> type[GalaxyModel]:
        return self.classes["lm"]

    @property
    def model_type(self) -> str:
        """The registry key, and HF's ``model_type``."""
        return self.lm.model_type

    def for_task(self, task: str) -> type[GalaxyModel]:
        """The class of this family with the head of ``task`` (one of ``tasks``)."""
        if task not in self.classes:
            raise ConfigError(f"{self.model_type} has no '{task}' head; its tasks are {', '.join(self.tasks)}")
        return self.classes[task]

    def __instancecheck__(self, model) -> bool:
        return isinstance(model, tuple(self.classes.values()))

    def __repr__(self) -> str:
        return f"<model family {self.model_type}>"

    # -- its config

    @property
    def gate_up_fusable(self) -> bool:
        """``fused_gate_up`` applies (a gated MLP)."""
        return self.lm.gate_up_fusable

    def check(self, cfg: ModelConfig) -> None:
        """The model keys only the family can check (``galaxy.config`` checks the rest)."""
        if cfg.fused_gate_up and not self.gate_up_fusable:
            raise ConfigError(f"config key 'fused_gate_up' fuses a gated MLP's gate_proj/up_proj, but model_type is "
                              f"'{cfg.model_type}'; set it to false")

    def fresh_for_task(self, task: str) -> tuple[str, ...]:
        """Parameter prefixes a pretraining checkpoint lacks (the head of ``task``)."""
        return self.for_task(task).fresh_for_task

    # -- HF conversion of the config (the weights: the classes' ``state_from_hf`` / ``state_to_hf``)

    def config_from_hf(self, hf: dict) -> ModelConfig:
        return self.lm.config_from_hf(hf)

    def hf_config(self, cfg: ModelConfig, dtype: Optional[torch.dtype] = None, task: str = "lm") -> dict:
        return self.for_task(task).hf_config(cfg, dtype)

    # -- shapes the planner's cost model reads (no model is built)

    def matmul_weights(self, cfg: ModelConfig, task: str = "lm") -> tuple[int, int]:
        """(per layer, head): the weights of the matmuls every token goes through, in elements, of the whole
        model -- N of MFU's ``6 N`` (``galaxy.profiler.model_flops``). Embedding lookups, biases and norms are
        no matmul work; a head that acts once per row (``classify``) is left out."""
        raise NotImplementedError

    def layer_parameters(self, cfg: ModelConfig, heads, ffn) -> LayerParameters:
        """One layer on a rank that holds ``heads`` query heads and ``ffn`` intermediate columns."""
        raise NotImplementedError

    def edge_parameters(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first stage's embeddings, last stage's head) parameters, without a tied head weight."""
        raise NotImplementedError

    def ties_embeddings(self, cfg: ModelConfig) -> bool:
        """The head reads the input embedding matrix (two pipeline stages then sum its gradient)."""
        return cfg.tie_word_embeddings

    # -- block probes the planner times: the family's own modules for a one-rank ``plan`` whose TP
    # shard is the size under test. Each is an nn.Module; the planner sets its weights and dtype.

    def att_proj_probe(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, seq: int) -> nn.Module:
        """``forward(x [b, s, hidden]) -> (q, k, v)`` as the attention core takes them (``seq``: the
        longest sequence, for position tables)."""
        raise NotImplementedError

    def att_out_probe(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext) -> nn.Module:
        """The attention output projection: ``forward(o [b, s, heads * head_dim]) -> [b, s, hidden]``."""
        raise NotImplementedError

    def mlp_probe(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext) -> nn.Module:
        """``forward(x) -> the MLP block's output`` (before its exit transition)."""
        raise NotImplementedError

    def con_probe(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext) -> nn.Module:
        """``forward(a, h)``: the CON block on a block output ``a`` and the residual stream ``h``."""
        raise NotImplementedError

    def head_probe(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext) -> nn.Module:
        """``forward(ids [b, s]) -> logits [b, s, vocab]``: embeddings, the final norm and the LM head."""
        raise NotImplementedError

    # -- side-tuning

    def side_spec(self, model: GalaxyModel, side_cfg: ModelConfig, side_plan: Plan):
        """The ``galaxy.adapters.side.SideSpec`` of a side network of ``side_cfg``-sized layers on
        ``side_plan`` beside ``model``'s layers."""
        raise ValueError(f"side-tuning is not supported for {self.model_type}")
