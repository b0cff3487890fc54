"""Qwen2 (HF ``Qwen2ForCausalLM``): LLaMA's architecture with biases on the q/k/v projections, so it
is ``LlamaForCausalLM`` with ``qkv_bias`` on (column-parallel biases, sharded with their heads) and
Qwen2's HF config: its defaults, ``model_type: qwen2``, no ``attention_bias`` key, and sliding-window
attention, which Galaxy does not implement, refused."""

from __future__ import annotations

from typing import Optional

import torch

from galaxy.config import ModelConfig
from galaxy.models.llama.hf import HF_DEFAULTS
from galaxy.models.llama.model import LlamaForCausalLM

# HF Qwen2Config defaults, for keys a config.json leaves out.
QWEN2_HF_DEFAULTS = dict(HF_DEFAULTS, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                         rms_norm_eps=1e-6)


class Qwen2ForCausalLM(LlamaForCausalLM):
    hf_architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    qkv_bias = True
    hf_defaults = QWEN2_HF_DEFAULTS

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        if hf.get("use_sliding_window"):
            raise ValueError("HF config has use_sliding_window=true; Galaxy's Qwen2 attends over the whole sequence")
        return super().config_from_hf(hf)

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        hf = super().hf_config(config, dtype)
        for key in ("attention_bias", "mlp_bias"):  # LLaMA's switches; Qwen2's biases are fixed
            del hf[key]
        hf.update(use_sliding_window=False, sliding_window=None)
        return hf
