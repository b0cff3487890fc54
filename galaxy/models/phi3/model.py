"""Phi-3 (HF ``Phi3ForCausalLM``) with HF's module tree and parameter names, on any plan: LLaMA's layer
(pre-norm RMSNorm, RoPE, SwiGLU, GQA) whose query, key and value projections are one ``qkv_proj`` and
whose gate and up projections are one ``gate_up_proj``:

    x = input_layernorm(h)
    qkv = att.enter(x, [qkv_proj]);  q, k, v = its parts;  h = h + att.leave(attention(q, k, v), o_proj)
    x = post_attention_layernorm(h)
    gate_up = mlp.enter(x, [gate_up_proj]);                h = h + mlp.leave(silu(gate) * up, down_proj)

``qkv_proj`` holds each key/value group whole (its query heads, its key, its value: ``galaxy.models.phi3.hf``),
so ATT.tp splits it by whole groups as it splits LLaMA's heads; the rest is LLaMA's (``galaxy.models.llama``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from galaxy.config import ModelConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.core.edges import LayerEdges
from galaxy.core.layers import StackedLinear
from galaxy.core.recompute import recomputed_when_compiled
from galaxy.models.llama.model import (KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RopeAt,
                                       block_input)
from galaxy.models.phi3.hf import Phi3HF


class Phi3Attention(LlamaAttention):
    """LLaMA's attention with one ``qkv_proj`` ``[kv_heads, group + 2, head_dim, hidden]``: under ATT.tp a
    rank holds whole key/value groups, ``heads_split[rank] // group`` of them."""

    def project_in(self, cfg: ModelConfig, plan: Plan, rank: int) -> None:
        groups = [n // self.group for n in plan.heads_split]
        self.qkv_proj = StackedLinear.for_method(plan.att, cfg.kv_heads, cfg.hidden_size,
                                                 (self.group + 2, self.head_dim), groups, rank, shard_dim=0)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv_proj``'s output -> q ``[b, s, heads * d]``, k and v ``[b, s, kv_heads * d]`` (query head
        ``j * group + i`` of group ``j``: HF's order)."""
        b, s, _ = qkv.shape
        groups = qkv.view(b, s, self.num_kv_heads, self.group + 2, self.head_dim)
        return (groups[..., : self.group, :].reshape(b, s, -1), groups[..., self.group, :].reshape(b, s, -1),
                groups[..., self.group + 1, :].reshape(b, s, -1))


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, layer_idx: int):
        super().__init__(replace(cfg, fused_gate_up=True), plan, ctx, layer_idx)  # gate_up_proj [2, I, H]

    def compute(self, h: torch.Tensor, key_padding_mask: Optional[torch.Tensor], rope: RopeAt,
                cache: Optional[KVCache] = None, edges: Optional[LayerEdges] = None) -> torch.Tensor:
        att_edge, mlp_edge = edges or self.edges
        attn = self.self_attn
        x = recomputed_when_compiled(block_input, self.input_layernorm, h)
        (qkv,) = att_edge.enter(x, [attn.qkv_proj])
        a = attn.attend(*attn.split_qkv(qkv), att_edge, key_padding_mask, rope, cache, self.attention_core)
        h = h + self.attn_dropout(att_edge.leave(a, attn.o_proj))
        x = recomputed_when_compiled(block_input, self.post_attention_layernorm, h)
        return h + self.mlp_dropout(mlp_edge.run(self.mlp, x))


class Phi3ForCausalLM(Phi3HF, LlamaForCausalLM):
    model_type = "phi3"
    hf_architecture = "Phi3ForCausalLM"
    gate_up_fusable = False  # gate and up are always one weight: the fused_gate_up key does not apply
    decoder_layer = Phi3DecoderLayer
