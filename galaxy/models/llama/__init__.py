"""LLaMA: the module (``model``), its HF conversion (``hf``) and the family object (``family``, ``LLAMA``)."""

from galaxy.models.llama.family import LLAMA, LlamaFamily
from galaxy.models.llama.hf import HF_DEFAULTS, LlamaHF
from galaxy.models.llama.model import (KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                       LlamaModel, LlamaRMSNorm, LlamaRotaryEmbedding, RopeAt, rope_inv_freq)

__all__ = ["LLAMA", "LlamaFamily", "HF_DEFAULTS", "LlamaHF", "KVCache", "LlamaAttention", "LlamaDecoderLayer",
           "LlamaForCausalLM", "LlamaMLP", "LlamaModel", "LlamaRMSNorm", "LlamaRotaryEmbedding", "RopeAt",
           "rope_inv_freq"]
