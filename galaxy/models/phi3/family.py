"""The Phi-3 family: LLaMA's facts and probes, its own model class, attention probe and small config."""

from __future__ import annotations

import torch

from galaxy.core.blocks import split_heads
from galaxy.models.llama.family import LlamaFamily, LlamaQKV
from galaxy.models.phi3.model import Phi3Attention, Phi3ForCausalLM


class Phi3QKV(LlamaQKV):
    """The fused q/k/v projection with RoPE on q and k (the planner's ``att_proj`` piece)."""

    attention_class = Phi3Attention

    def forward(self, x):
        a = self.attn
        q, k, v = a.split_qkv(a.qkv_proj(x))
        q, k = self.rope(split_heads(q, a.num_heads, a.head_dim), split_heads(k, a.num_kv_heads, a.head_dim),
                         torch.arange(x.shape[1], device=x.device))
        return q, k, v


class Phi3Family(LlamaFamily):
    classes = {"lm": Phi3ForCausalLM}
    tiny_config = dict(preset="llama-tiny", model_type="phi3")
    lora_targets = ("o_proj", "down_proj")  # the fused q/k/v and gate/up weights take no LoRA

    def att_proj_probe(self, cfg, plan, ctx, seq):
        return Phi3QKV(cfg, plan, ctx, seq)


PHI3 = Phi3Family()
