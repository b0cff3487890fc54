"""The LLaMA family to the rest of the house (``galaxy.models.family``): its facts, the shapes the
planner's cost model reads, the block probes it times, and its side network."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.config import Method, ModelConfig, Plan
from galaxy.core.blocks import split_heads
from galaxy.core.context import ParallelContext
from galaxy.core.edges import LocalEdge
from galaxy.core.layers import Dropout
from galaxy.models.base import GalaxyModel, LayerParameters
from galaxy.models.family import Family
from galaxy.models.llama.model import (LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                       RopeAt)

# ----------------------------------------------------------------------------- planner probes


class LlamaQKV(nn.Module):
    """ATT's q/k/v projections with RoPE on q and k (the planner's ``att_proj`` piece): q, k
    ``[b, heads, s, d]`` rotated at positions 0..s-1, v ``[b, s, kv_heads * d]``."""

    attention_class = LlamaAttention

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, seq: int):
        super().__init__()
        self.attn = self.attention_class(cfg, plan, ctx, 0)
        cos, sin = LlamaRotaryEmbedding(cfg, ctx.device)(torch.arange(seq, device=ctx.device)[None], torch.float32)
        self.rope = RopeAt(cos, sin, cfg.kernels)

    def forward(self, x):
        a = self.attn
        q, k = split_heads(a.q_proj(x), a.num_heads, a.head_dim), split_heads(a.k_proj(x), a.num_kv_heads, a.head_dim)
        q, k = self.rope(q, k, torch.arange(x.shape[1], device=x.device))
        return q, k, a.v_proj(x)


class LlamaMLPBlock(nn.Module):
    """The MLP between local edges, no transition (the planner's ``mlp`` piece)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.mlp, self.edge = LlamaMLP(cfg, plan, ctx), LocalEdge(ctx.mp, plan, plan.mlp)

    def forward(self, x):
        return self.mlp(x, self.edge)


class LlamaCon(nn.Module):
    """CON: the residual add (after the optional dropout), then the next block's RMSNorm (pre-norm)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.kernels)
        self.dropout = Dropout(cfg.hidden_dropout_prob, ctx.generator(sharded=plan.con == Method.SP))

    def forward(self, a, h):
        h = h + self.dropout(a)
        return h, self.norm(h)


class LlamaEmbeddingsAndHead(nn.Module):
    """The token embeddings, the final norm and ``lm_head`` (the embedding matrix when tied)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.kernels)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids):
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(self.norm(self.embed_tokens(ids)), head.weight)


# ----------------------------------------------------------------------------- the family


class LlamaFamily(Family):
    classes = {"lm": LlamaForCausalLM}
    causal = True
    rotary = True
    tiny_config = dict(preset="llama-tiny")
    lora_targets = ("q_proj", "v_proj")
    # The block outputs before ``h + .``.
    adapter_points = {"attn": r"(.+\.)?layers\.\d+\.attn_dropout", "mlp": r"(.+\.)?layers\.\d+\.mlp_dropout"}

    def matmul_weights(self, cfg: ModelConfig, task: str = "lm") -> tuple[int, int]:
        h, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size, h * cfg.vocab_size  # q, o, k, v, MLP; lm_head

    def layer_parameters(self, cfg: ModelConfig, heads, ffn) -> LayerParameters:
        cfg = self.lm.own_config(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        kv = heads // (cfg.num_attention_heads // cfg.kv_heads)
        qkv = (heads + 2 * kv) * d
        return LayerParameters(att_sharded=qkv * h + (qkv if cfg.qkv_bias else 0) + h * heads * d, att_row_bias=0,
                               mlp_sharded=3 * ffn * h, mlp_row_bias=0, con=2 * h)  # two RMSNorms

    def edge_parameters(self, cfg: ModelConfig) -> tuple[int, int]:
        h, v = cfg.hidden_size, cfg.vocab_size
        return v * h, h + (0 if cfg.tie_word_embeddings else v * h)  # embeddings; final norm + lm_head

    def att_proj_probe(self, cfg, plan, ctx, seq):
        return LlamaQKV(self.lm.own_config(cfg), plan, ctx, seq)

    def att_out_probe(self, cfg, plan, ctx):
        return LlamaAttention(self.lm.own_config(cfg), plan, ctx, 0).o_proj

    def mlp_probe(self, cfg, plan, ctx):
        return LlamaMLPBlock(cfg, plan, ctx)

    def con_probe(self, cfg, plan, ctx):
        return LlamaCon(cfg, plan, ctx)

    def head_probe(self, cfg, plan, ctx):
        return LlamaEmbeddingsAndHead(cfg)

    def side_spec(self, model: GalaxyModel, side_cfg: ModelConfig, side_plan: Plan):
        from galaxy.adapters.side import SideSpec

        layers = list(model.model.layers)
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # trainable: fp32 masters
        with torch.device(model.ctx.device):
            side_layers = [type(model).decoder_layer(side_cfg, side_plan, model.ctx, i).to(dtype)
                           for i in range(len(layers))]
            final_norm = LlamaRMSNorm(side_cfg.hidden_size, model.config.rms_norm_eps).to(dtype)
        rotary = LlamaRotaryEmbedding(side_cfg)  # the side heads are narrower: their own RoPE tables

        def prepare(call: dict, s: torch.Tensor) -> dict:
            if call.get("cache") is not None:
                raise ValueError("side-tuning keeps no KV cache for its side network; generate with use_cache=False")
            positions = call.get("position_ids")
            if positions is None:
                positions = torch.arange(call["input_ids"].shape[1], device=s.device)
            if positions.dim() == 1:
                positions = positions[None]
            return {"side_rope": RopeAt(*rotary(positions, s.dtype))}

        return SideSpec(model.model, layers, side_layers, model.config.hidden_size, side_cfg.hidden_size,
                        run_layer=lambda layer, s, call: layer(s, call["attention_mask"], call["side_rope"]),
                        prepare=prepare, final_norm=final_norm, init_full=model._init_full)


LLAMA = LlamaFamily()
