"""Typed, validated run configuration loaded from JSON.

A config file is either nested (``{"model": {...}, "parallel": {...}, "train": {...},
"data": {...}, "distributed": {...}, "peft": {...}}``) or flat, as in the original Galaxy-LM
files (``{"hidden_size": 768, "pad_size": 128, "att_parallel_method": "TP", ...}``). Every key
name is unique across sections, so a flat key always finds its section. Unknown keys are errors
that name the closest valid key; nothing is dropped silently.

``GalaxyConfig.resolve_plan(mp_size)`` turns the parallel section into a ``Plan``: one method
per block and the per-rank head, FFN and sequence splits, validated against the model.

From the bottom up: ``sections`` (the typed sections, ``Method``, the allowed values), ``presets`` (model
sizes, plans), ``keys`` (raw JSON to canonical keys), ``plan`` (``Plan`` and its resolution), ``checks``
(every cross-key check), ``galaxy_config`` (``GalaxyConfig``: load, check, resolve).
"""

from galaxy.config.galaxy_config import GalaxyConfig
from galaxy.config.keys import canonical_keys, parse_override, read_config_file, read_json_object
from galaxy.config.plan import Plan, balanced_split
from galaxy.config.presets import MODEL_PRESETS, PLAN_PRESETS
from galaxy.config.sections import (COMPUTE_KEYS, DP_ENGINES, KEY_SECTION, LAYER_MEMORY_MODES, MP_GRAD_REDUCE,
                                    OFFLOAD, OPTIMIZERS, RECOMPUTE_MODES, SECTIONS, SP_ATTENTIONS, ConfigError,
                                    ConfigSections, DataConfig, DistributedConfig, Method, ModelConfig,
                                    ParallelConfig, PeftConfig, TrainConfig, fused_gate_up_targets)

__all__ = ["GalaxyConfig", "ConfigSections", "ModelConfig", "ParallelConfig", "TrainConfig", "DataConfig",
           "DistributedConfig", "PeftConfig", "ConfigError", "Method", "Plan", "balanced_split", "MODEL_PRESETS",
           "PLAN_PRESETS", "SECTIONS", "KEY_SECTION", "COMPUTE_KEYS", "DP_ENGINES", "LAYER_MEMORY_MODES",
           "MP_GRAD_REDUCE", "OFFLOAD", "OPTIMIZERS", "RECOMPUTE_MODES", "SP_ATTENTIONS", "fused_gate_up_targets",
           "canonical_keys", "parse_override", "read_config_file", "read_json_object"]
