"""LLaMA (pre-norm, RMSNorm, RoPE, SwiGLU, GQA, causal LM) with the module tree and parameter
names of HF ``LlamaForCausalLM``, on any plan.

A layer is the chain ATT -> CON -> MLP -> CON, the residual stream living in CON's layout; each block
meets the stream through its edges (``galaxy.core.edges``: the transition and the linears):

    x = input_layernorm(h)
    q, k, v = att.enter(x, [q_proj, k_proj, v_proj]);  h = h + att.leave(attention(q, k, v), o_proj)
    x = post_attention_layernorm(h)
    gate, up = mlp.enter(x, [gate_proj, up_proj]);     h = h + mlp.leave(silu(gate) * up, down_proj)

``ParallelLinear.for_method`` picks whole / column / row weights for each block's method; how the
edges run, what is recomputed and what is compiled is set from outside (``galaxy.core.parallelize``).
Under ATT.tp, rank i holds ``heads_split[i]`` query heads and ``heads_split[i] // group`` key/value
heads, so a GQA group never straddles two ranks (``resolve_plan`` rejects splits that would).

Rotary embeddings are applied inside the shared ``self_attention`` through its ``rope`` callback,
which receives the *global* sequence positions of the local queries (SP included), so one
cos/sin table per forward serves every plan. A KV cache (``past_key_values``/``use_cache``)
serves ``model.generate`` (``galaxy.models.generation``) on every plan: the cache holds the whole
sequence of each rank's heads (ATT.sp gathers K and V in the prefill, as its forward does), the
layers run eagerly on plain edges, and under SP the steps after the prefill run their new tokens
replicated (``LlamaModel.decode_edges``).

Options of how it computes (``ModelConfig``): ``fused_gate_up`` holds gate and up as one
``mlp.gate_up_proj.weight`` ``[2, intermediate, hidden]`` (one matmul; HF checkpoints are
converted both ways by ``state_from_hf`` / ``state_to_hf``); ``kernels`` runs RMSNorm, RoPE, SwiGLU
and the head with its loss on the Triton kernels of ``galaxy.kernels``.

Under pipeline parallelism (``ctx.pp.size > 1``) a model is one stage (``galaxy.core.pipeline``):
``model.layers.i`` under their global indices, ``embed_tokens`` on the first stage, the final
norm and ``lm_head`` on the last. With tied embeddings the last stage holds its own copy of
``model.embed_tokens`` for the head; the two copies' gradients are summed after backward.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.config import ConfigError, Method, ModelConfig, Plan
from galaxy.core.attention import attention
from galaxy.core.blocks import gather_kv, merge_heads, self_attention, split_heads
from galaxy.core.context import ParallelContext
from galaxy.core.edges import Edge, LayerEdges, LocalEdge, Stream, in_compute_dtype
from galaxy.core.grad_sync import mark_pipeline_tie
from galaxy.core.layers import Dropout, GradRule, ParallelLinear, StackedLinear, mark_module, region_rule
from galaxy.core.parallelize import TransformerLayer
from galaxy.core.pipeline import StageSpec, layer_stack
from galaxy.core.recompute import recomputed_when_compiled
from galaxy.core.transitions import reduce_to_replicated
from galaxy.kernels import apply_rope, fused_linear_cross_entropy, rms_norm, swiglu, swiglu_packed
from galaxy.models.generation import generate
from galaxy.models.base import (GalaxyModel, LayerParameters, ModelOutput, activation, at_least_fp32,
                                default_plan_and_context, plain, token_loss_sum, use_triton)

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROPE_TYPES = ("default", "linear", "llama3")
# HF config keys that map one-to-one onto ModelConfig fields.
HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "intermediate_size", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
           "tie_word_embeddings")
# HF LlamaConfig defaults, for keys a config.json leaves out.
HF_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)
# Kept from a loaded checkpoint and written back on save (HF falls back to LLaMA-1's ids otherwise).
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id")
# fused_gate_up: one parameter in place of HF's two (gate first).
GATE, UP, GATE_UP = "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_up_proj.weight"


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig, device: Optional[torch.device] = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` in fp32, computed as HF's ``_compute_default_rope_parameters``,
    ``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters`` do."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config key 'rope_scaling': rope type '{kind}' is not supported; use one of "
                          f"{', '.join(ROPE_TYPES)}")
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(kind, ())
    if any(k not in scaling for k in needs):
        raise ConfigError(f"config key 'rope_scaling': rope type '{kind}' needs {', '.join(needs)}; got {scaling}")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables for given position ids. ``inv_freq`` is a plain fp32 tensor, not a buffer, so
    ``model.half()`` / ``.double()`` cannot round it and it never enters a state dict. It is made on
    ``device`` (the model's) even when the parameters are laid out on the meta device."""

    def __init__(self, cfg: ModelConfig, device: Optional[torch.device] = None):
        super().__init__()
        self.inv_freq = rope_inv_freq(cfg, device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` ``[b or 1, s]`` -> cos, sin ``[b or 1, s, head_dim]`` (fp32 math, as HF)."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeAt:
    """The ``rope(q, k, idx)`` callback of ``self_attention``: ``idx`` are indices into the
    sequence the tables were built for (global positions under SP), so each rank rotates its
    local queries and keys at their true positions before K/V are gathered. cos/sin are
    ``rotate_half`` tables as ``LlamaRotaryEmbedding`` makes them (their two halves equal)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "auto"):
        self.cos, self.sin, self.kernels = cos, sin, kernels

    def __call__(self, q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[:, idx], self.sin[:, idx]  # [b or 1, s, d]
        if use_triton(self.kernels, q, "rope"):
            # LlamaRotaryEmbedding's halves are equal: the kernel reads only the first.
            half = cos.shape[-1] // 2
            return apply_rope(q, k, cos[..., :half], sin[..., :half], backend="triton")
        return apply_rope(q, k, cos, sin, backend="torch")


# ----------------------------------------------------------------------------- KV cache


class KVCache:
    """Per-layer keys and values (after RoPE) of the tokens seen so far: ``[b, kv_heads_local, t, d]``."""

    def __init__(self):
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def seen(self, idx: int) -> int:
        """Tokens layer ``idx`` holds (before this step's, while the step runs the layers in order)."""
        return self.layers[idx][0].shape[2] if idx < len(self.layers) else 0

    def update(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx < len(self.layers):
            past_k, past_v = self.layers[idx]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            self.layers[idx] = (k, v)
        else:
            assert idx == len(self.layers), "layers fill the cache in order"
            self.layers.append((k, v))
        return k, v


@dataclass
class CausalLMOutput(ModelOutput):
    past_key_values: Optional[KVCache] = None


# ----------------------------------------------------------------------------- modules


class LlamaRMSNorm(nn.Module):
    """HF ``LlamaRMSNorm``: statistics in fp32 (fp64 stays fp64), cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float, kernels: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(self.kernels, x, "rms_norm"):
            return rms_norm(x, self.weight, self.variance_epsilon, backend="triton")
        h = at_least_fp32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def block_input(norm: LlamaRMSNorm, h: torch.Tensor) -> torch.Tensor:
    """A block's input: the pre-norm's output in the compute dtype. Cast here, not at the block's entry, so
    that a compiled layer rebuilds the cast copy in backward with the norm (``recomputed_when_compiled``)
    instead of keeping it: under autocast over fp32 weights that copy is what the projections keep."""
    return in_compute_dtype(norm(h))


def _norm(cfg: ModelConfig, plan: Plan) -> LlamaRMSNorm:
    # Norms run on the residual stream, i.e. in CON's layout.
    return mark_module(LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.kernels), region_rule(plan.con))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, layer_idx: int):
        super().__init__()
        rank, h, d = ctx.mp.rank, cfg.hidden_size, cfg.head_dim
        group = cfg.num_attention_heads // cfg.kv_heads
        self.layer_idx, self.head_dim = layer_idx, d
        self.num_heads = plan.heads_split[rank] if plan.att == Method.TP else cfg.num_attention_heads
        self.num_kv_heads = self.num_heads // group
        q_split = [n * d for n in plan.heads_split]
        kv_split = [n // group * d for n in plan.heads_split]
        bias = bool(cfg.qkv_bias)  # column-parallel biases are sharded with their columns
        self.q_proj = ParallelLinear.for_method(plan.att, h, cfg.num_attention_heads * d, bias, "column", q_split, rank)
        self.k_proj = ParallelLinear.for_method(plan.att, h, cfg.kv_heads * d, bias, "column", kv_split, rank)
        self.v_proj = ParallelLinear.for_method(plan.att, h, cfg.kv_heads * d, bias, "column", kv_split, rank)
        self.o_proj = ParallelLinear.for_method(plan.att, cfg.num_attention_heads * d, h, False, "row", q_split, rank)
        self.dropout = Dropout(cfg.attention_probs_dropout_prob, ctx.generator(sharded=plan.att != Method.NONE))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edge: Edge, key_padding_mask,
                rope: "RopeAt", cache: Optional[KVCache] = None, core=attention) -> torch.Tensor:
        """Causal attention of the projections in the block's layout (``edge``), the output projection's input."""
        if cache is not None:
            return self.cached(q, k, v, edge, key_padding_mask, rope, cache)
        return self_attention(q, k, v, shard=edge.shard, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                              head_dim=self.head_dim, key_padding_mask=key_padding_mask, causal=True,
                              dropout=self.dropout, rope=rope, core=core)

    def cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edge: Edge, key_padding_mask,
               rope: "RopeAt", cache: KVCache) -> torch.Tensor:
        """Attention of new tokens against cached + new keys. The cache always holds the whole
        sequence of this rank's heads: the new tokens are the whole sequence (every step of plans
        without SP, and every step after the prefill of plans with SP, whose new tokens run
        replicated), or, for the prefill of ATT.sp, this rank's tokens (``edge.shard``), whose K and V
        are gathered as ``self_attention`` gathers them."""
        q, k, v = (split_heads(t, n, self.head_dim) for t, n in ((q, self.num_heads), (k, self.num_kv_heads),
                                                                  (v, self.num_kv_heads)))
        offset = edge.shard.offset if edge.shard is not None else 0
        q, k = rope(q, k, torch.arange(offset, offset + q.shape[2], device=q.device))
        if edge.shard is not None:
            k, v = gather_kv(k, v, edge.shard)
        past = cache.seen(self.layer_idx)
        k, v = cache.update(self.layer_idx, k, v)
        return merge_heads(attention(q, k, v, key_padding_mask=key_padding_mask, causal=True, q_offset=past + offset,
                                     dropout=self.dropout))


def _gated(act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act_fn(gate) * up


class LlamaMLP(nn.Module):
    """SwiGLU: gate/up column-parallel and down row-parallel under MLP.tp; whole otherwise. With
    ``fused_gate_up`` gate and up are one ``gate_up_proj`` (one matmul, one ``[2, intermediate,
    hidden]`` weight, ``StackedLinear``)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        rank, h, i = ctx.mp.rank, cfg.hidden_size, cfg.intermediate_size
        self.fused = cfg.fused_gate_up
        if self.fused:
            self.gate_up_proj = StackedLinear.for_method(plan.mlp, 2, h, i, plan.ffn_split, rank)
        else:
            self.gate_proj = ParallelLinear.for_method(plan.mlp, h, i, False, "column", plan.ffn_split, rank)
            self.up_proj = ParallelLinear.for_method(plan.mlp, h, i, False, "column", plan.ffn_split, rank)
        self.down_proj = ParallelLinear.for_method(plan.mlp, i, h, False, "row", plan.ffn_split, rank)
        self.act_fn = activation(cfg.hidden_act)
        self.swiglu = cfg.hidden_act in ("silu", "swish")  # what the SwiGLU kernels compute
        self.kernels = cfg.kernels

    # Compiled, the activation runs in a recomputed region: down_proj's weight gradient reads it, and
    # backward rebuilds it from gate and up (kept for the activation's own backward) instead of keeping it.
    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.swiglu and use_triton(self.kernels, gate, "swiglu"):
            return swiglu(gate, up, backend="triton")
        return recomputed_when_compiled(_gated, self.act_fn, gate, up)

    def act_packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` on the fused projection's ``[gate | up]`` output."""
        if self.swiglu and use_triton(self.kernels, gate_up, "swiglu_packed"):
            return swiglu_packed(gate_up, backend="triton")
        return recomputed_when_compiled(_gated, self.act_fn, *gate_up.chunk(2, dim=-1))

    def forward(self, x: torch.Tensor, edge: Edge) -> torch.Tensor:
        """The MLP block between its edges."""
        if self.fused:
            (gate_up,) = edge.enter(x, [self.gate_up_proj])
            return edge.leave(self.act_packed(gate_up), self.down_proj)
        gate, up = edge.enter(x, [self.gate_proj, self.up_proj])
        return edge.leave(self.act(gate, up), self.down_proj)


class LlamaDecoderLayer(TransformerLayer):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, layer_idx: int):
        super().__init__(ctx.mp, plan)
        self.self_attn = LlamaAttention(cfg, plan, ctx, layer_idx)
        self.mlp = LlamaMLP(cfg, plan, ctx)
        self.input_layernorm = _norm(cfg, plan)
        self.post_attention_layernorm = _norm(cfg, plan)
        # HF LLaMA has no residual dropout; hidden_dropout_prob (0 in every preset) adds one in CON,
        # a module per residual add so adapters can be injected after each by name.
        generator = ctx.generator(sharded=plan.con == Method.SP)
        self.attn_dropout = Dropout(cfg.hidden_dropout_prob, generator)
        self.mlp_dropout = Dropout(cfg.hidden_dropout_prob, generator)

    def forward(self, h: torch.Tensor, key_padding_mask: Optional[torch.Tensor], rope: RopeAt,
                cache: Optional[KVCache] = None, edges: Optional[LayerEdges] = None) -> torch.Tensor:
        if cache is not None:  # generation: eager (the cache grows every step, a new shape to compile)
            return self.compute(h, key_padding_mask, rope, cache, edges)
        return super().forward(h, key_padding_mask, rope)

    def compute(self, h: torch.Tensor, key_padding_mask: Optional[torch.Tensor], rope: RopeAt,
                cache: Optional[KVCache] = None, edges: Optional[LayerEdges] = None) -> torch.Tensor:
        """``edges``: the block edges to run (default the layer's own; generation passes plain ones)."""
        att_edge, mlp_edge = edges or self.edges
        attn = self.self_attn
        x = recomputed_when_compiled(block_input, self.input_layernorm, h)
        q, k, v = att_edge.enter(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        a = attn(q, k, v, att_edge, key_padding_mask, rope, cache, self.attention_core)
        h = h + self.attn_dropout(att_edge.leave(a, attn.o_proj))
        x = recomputed_when_compiled(block_input, self.post_attention_layernorm, h)
        return h + self.mlp_dropout(mlp_edge.run(self.mlp, x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, stage: Optional[StageSpec] = None):
        super().__init__()
        self.cfg, self.plan, self.ctx = cfg, plan, ctx
        self.stage = stage = stage or StageSpec.whole(cfg.num_hidden_layers)
        self.stream = Stream(ctx.mp, plan)
        # Generation runs plain edges: the prefill's on the plan, and after an SP prefill the new tokens
        # replicated on every rank, SP blocks (whose weights are whole) computing them as 'none' blocks
        # do, TP blocks keeping their shards.
        decode_plan = replace(plan, **{block: Method.NONE for block in ("att", "con", "mlp")
                                       if getattr(plan, block) == Method.SP})
        self.prefill_edges = LayerEdges.plain(ctx.mp, plan)
        self.decode_edges, self.decode_stream = LayerEdges.plain(ctx.mp, decode_plan), Stream(ctx.mp, decode_plan)
        tied = cfg.tie_word_embeddings and not stage.is_whole
        if stage.is_first or (tied and stage.is_last):
            self.embed_tokens = mark_module(nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                                         padding_idx=cfg.pad_token_id), region_rule(plan.con))
            if tied:
                mark_pipeline_tie(self.embed_tokens.weight, "embed_tokens", copy=not stage.is_first)
        else:
            self.embed_tokens = None
        self.layers = layer_stack((LlamaDecoderLayer(cfg, plan, ctx, i) for i in stage.layers), stage.first_layer)
        self.norm = _norm(cfg, plan) if stage.is_last else None
        self.rotary_emb = LlamaRotaryEmbedding(cfg, ctx.device)

    @property
    def uses_seq(self) -> bool:
        return Method.SP in (self.plan.att, self.plan.con, self.plan.mlp) and self.ctx.mp.size > 1

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: Optional[KVCache] = None,
                hidden_states: Optional[torch.Tensor] = None):
        """Final-norm hidden states in the stream's layout (this rank's tokens under CON.sp). A
        pipeline stage after the first starts from ``hidden_states``; one before the last returns
        its last layer's output without the final norm."""
        if not self.stage.is_whole and cache is not None:
            raise ValueError("the KV cache is not supported on a pipeline stage; generate with pp_size 1")
        if not self.stage.is_first and hidden_states is None:
            raise ValueError(f"pipeline stage {self.stage.index} starts at layer {self.stage.first_layer}: "
                             "pass the previous stage's output as hidden_states")
        seq = input_ids.shape[1]
        past = cache.length if cache is not None else 0
        edges = None if cache is None else self.decode_edges if past else self.prefill_edges
        stream = self.decode_stream if past else self.stream
        if self.uses_seq and not past:
            if seq != sum(self.plan.seq_split):
                raise ValueError(f"input has {seq} tokens but the plan splits {sum(self.plan.seq_split)} "
                                 f"(seq_scatter_list {list(self.plan.seq_split)}); pad inputs to seq_length")
        if attention_mask is not None and attention_mask.shape[1] != past + seq:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens but there are {past} cached "
                             f"and {seq} new ones; it must cover both")
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        h = self.embed_tokens(stream.to_stream(input_ids)) if self.stage.is_first else hidden_states
        rope = RopeAt(*self.rotary_emb(position_ids, h.dtype), self.cfg.kernels)
        for layer in self.layers:
            h = layer(h, attention_mask, rope, cache, edges)
        return self.norm(h) if self.stage.is_last else h


def fuse_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's ``mlp.gate_proj.weight`` / ``mlp.up_proj.weight`` pairs -> ``mlp.gate_up_proj.weight`` [2, I, H].
    Also maps per-parameter optimizer states: a 0-dim one (a step count) is the gate's."""
    out = {}
    for name, tensor in state.items():
        stem = name[: -len(GATE)] if name.endswith(GATE) else name[: -len(UP)] if name.endswith(UP) else None
        if stem is None or stem + GATE not in state or stem + UP not in state:
            out[name] = tensor  # not a complete pair: left for the loader to name
        elif name.endswith(GATE):
            out[stem + GATE_UP] = tensor if tensor.dim() == 0 else torch.stack([tensor, state[stem + UP]])
    return out


def split_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mlp.gate_up_proj.weight`` -> HF's separate ``gate_proj`` and ``up_proj`` weights (a 0-dim
    optimizer state goes to both)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(GATE_UP):
            stem = name[: -len(GATE_UP)]
            halves = (tensor, tensor) if tensor.dim() == 0 else (tensor[0], tensor[1])
            out[stem + GATE], out[stem + UP] = (t.clone() for t in halves)  # own storage: safetensors
        else:
            out[name] = tensor
    return out


class TiedLMHead(nn.Module):
    """``lm_head`` when ``tie_word_embeddings``: the embedding matrix, no parameter of its own."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = [embed_tokens]  # a list keeps the tied module out of this subtree

    @property
    def weight(self) -> torch.Tensor:
        return self.embed_tokens[0].weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


# ----------------------------------------------------------------------------- planner probes


class LlamaQKV(nn.Module):
    """ATT's q/k/v projections with RoPE on q and k (the planner's ``att_proj`` piece): q, k
    ``[b, heads, s, d]`` rotated at positions 0..s-1, v ``[b, s, kv_heads * d]``."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, seq: int):
        super().__init__()
        self.attn = LlamaAttention(cfg, plan, ctx, 0)
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


# ----------------------------------------------------------------------------- the model


class LlamaForCausalLM(GalaxyModel):
    hf_architecture = "LlamaForCausalLM"
    model_type = "llama"
    causal = True
    rotary = True
    tiny_config = dict(preset="llama-tiny")
    lora_targets = ("q_proj", "v_proj")
    # The block outputs before ``h + .``.
    adapter_points = {"attn": r"(.+\.)?layers\.\d+\.attn_dropout", "mlp": r"(.+\.)?layers\.\d+\.mlp_dropout"}
    gate_up_fusable = True
    qkv_bias = False  # HF's architecture has q/k/v biases (a config's qkv_bias None takes this)
    hf_defaults = HF_DEFAULTS

    @classmethod
    def own_config(cls, config: ModelConfig) -> ModelConfig:
        """``config`` with what it leaves to the architecture filled in (``qkv_bias``)."""
        return config if config.qkv_bias is not None else replace(config, qkv_bias=cls.qkv_bias)

    @classmethod
    def matmul_weights(cls, cfg: ModelConfig, task: str = "lm") -> tuple[int, int]:
        h, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size, h * cfg.vocab_size  # q, o, k, v, MLP; lm_head

    @classmethod
    def layer_parameters(cls, cfg: ModelConfig, heads, ffn) -> LayerParameters:
        cfg = cls.own_config(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        kv = heads // (cfg.num_attention_heads // cfg.kv_heads)
        qkv = (heads + 2 * kv) * d
        return LayerParameters(att_sharded=qkv * h + (qkv if cfg.qkv_bias else 0) + h * heads * d, att_row_bias=0,
                               mlp_sharded=3 * ffn * h, mlp_row_bias=0, con=2 * h)  # two RMSNorms

    @classmethod
    def edge_parameters(cls, cfg: ModelConfig) -> tuple[int, int]:
        h, v = cfg.hidden_size, cfg.vocab_size
        return v * h, h + (0 if cfg.tie_word_embeddings else v * h)  # embeddings; final norm + lm_head

    @classmethod
    def att_proj_probe(cls, cfg, plan, ctx, seq):
        return LlamaQKV(cls.own_config(cfg), plan, ctx, seq)

    @classmethod
    def att_out_probe(cls, cfg, plan, ctx):
        return LlamaAttention(cls.own_config(cfg), plan, ctx, 0).o_proj

    @classmethod
    def mlp_probe(cls, cfg, plan, ctx):
        return LlamaMLPBlock(cfg, plan, ctx)

    @classmethod
    def con_probe(cls, cfg, plan, ctx):
        return LlamaCon(cfg, plan, ctx)

    @classmethod
    def head_probe(cls, cfg, plan, ctx):
        return LlamaEmbeddingsAndHead(cfg)

    def side_spec(self, side_cfg: ModelConfig, side_plan: Plan):
        from galaxy.adapters.side import SideSpec

        layers = list(self.model.layers)
        dtype = torch.promote_types(next(self.parameters()).dtype, torch.float32)  # trainable: fp32 masters
        with torch.device(self.ctx.device):
            side_layers = [LlamaDecoderLayer(side_cfg, side_plan, self.ctx, i).to(dtype) for i in range(len(layers))]
            final_norm = LlamaRMSNorm(side_cfg.hidden_size, self.config.rms_norm_eps).to(dtype)
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

        return SideSpec(self.model, layers, side_layers, self.config.hidden_size, side_cfg.hidden_size,
                        run_layer=lambda layer, s, call: layer(s, call["attention_mask"], call["side_rope"]),
                        prepare=prepare, final_norm=final_norm, init_full=self._init_full)

    def __init__(self, config: ModelConfig, plan: Optional[Plan] = None, ctx: Optional[ParallelContext] = None,
                 seed: int = 0, meta: bool = False):
        config = self.own_config(config)
        plan, ctx = default_plan_and_context(config, plan, ctx)
        super().__init__(config, plan, ctx)
        # Instance attribute: only a tied model drops lm_head.weight from checkpoints.
        self.tied_keys = {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_word_embeddings else {}
        self.special_token_ids: dict = {}
        self.fused_gate_up = config.fused_gate_up  # the layout built, whatever the config says later
        with self.parameter_device(meta):
            self.model = LlamaModel(config, plan, ctx, self.stage)
            if not self.stage.is_last:
                self.lm_head = None
            elif config.tie_word_embeddings:
                self.lm_head = TiedLMHead(self.model.embed_tokens)
            else:
                # The head runs on the stream's (local) tokens: whole weight, CON's rule.
                self.lm_head = ParallelLinear(config.hidden_size, config.vocab_size, bias=False,
                                              rule=region_rule(plan.con))
        if not meta:
            self.init_weights(seed)
        mark_module(self, GradRule.REPLICATED)
        self.parallelize()

    @staticmethod
    def num_loss_targets(labels: torch.Tensor) -> torch.Tensor:
        """The loss is a sum over the shifted non-ignored labels divided by their count (the
        training loop weights micro-batches and dp shards by it)."""
        return (labels[:, 1:] != IGNORE_INDEX).sum()

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: int = 20, **kwargs) -> torch.Tensor:
        """``model.generate`` with HF's argument names (``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``eos_token_id``, ``use_cache``, and ``generator`` for seeded sampling); returns the
        prompt and the new tokens, ``[b, s + n]``. See :func:`galaxy.models.generation.generate`."""
        return generate(self, input_ids, max_new_tokens, attention_mask=attention_mask, **kwargs)

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None,
                past_key_values: Optional[KVCache] = None, use_cache: bool = False,
                hidden_states: Optional[torch.Tensor] = None) -> CausalLMOutput:
        """``input_ids``, ``attention_mask`` (1 = token, 0 = padding; covering cached tokens too),
        ``labels`` and ``position_ids`` are full and replicated on every rank. Logits come back in
        the stream's layout; the loss is HF's causal-LM mean over non-ignored shifted labels."""
        cache = past_key_values if past_key_values is not None else (KVCache() if use_cache else None)
        h = self.model(input_ids, attention_mask, position_ids, cache, hidden_states)
        if not self.stage.is_last:
            return CausalLMOutput(hidden_states=h)
        # Training with Triton kernels: the head and the loss are one chunked kernel that never holds
        # the [tokens, vocab] logits (so none are returned); a wrapped head (LoRA) keeps its own call.
        fused = (labels is not None and self.training
                 and use_triton(self.config.kernels, h, "fused_linear_cross_entropy")
                 and type(self.lm_head) in (ParallelLinear, TiedLMHead) and plain(self.lm_head))
        logits = None if fused else self.lm_head(h)
        loss = None
        if labels is not None:
            # Position t predicts labels[t + 1]: shift the full labels first, then take this rank's
            # slice, so every shard scores its own logits and nothing gathers the full logits.
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            count = (shifted != IGNORE_INDEX).sum().clamp(min=1)
            local = self.model.stream.to_stream(shifted)
            if fused:
                loss = fused_linear_cross_entropy(h, self.lm_head.weight, local, IGNORE_INDEX, "mean",
                                                  num_targets=count, backend="triton")
            else:
                loss = token_loss_sum(logits, local, count, self.config.kernels, IGNORE_INDEX)
            if self.model.stream.sharded:
                loss = reduce_to_replicated(loss, self.ctx.mp)  # per-rank sums are partial
        return CausalLMOutput(loss=loss, logits=logits, hidden_states=h, past_key_values=cache)

    # -- init and HF conversion

    def _init_param(self, name: str, shape, seed: int, device: Optional[torch.device] = None) -> torch.Tensor:
        if name.endswith(GATE_UP):  # each half drawn as the unfused model draws it
            stem, init = name[: -len(GATE_UP)], super()._init_param
            return torch.stack([init(stem + part, tuple(shape[1:]), seed, device) for part in (GATE, UP)])
        return super()._init_param(name, shape, seed, device)

    def state_from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fuse_gate_up(state) if self.fused_gate_up else split_gate_up(state)

    @classmethod
    def state_to_hf(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return split_gate_up(state)

    def _init_full(self, name: str, shape, gen: torch.Generator) -> torch.Tensor:
        # HF LlamaPreTrainedModel._init_weights: N(0, initializer_range) linears and embeddings,
        # unit RMSNorm scales, a zero padding row when a pad token is set.
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return torch.ones(shape, device=gen.device)
        if name.endswith(".bias"):  # HF inits linear biases to zero
            return torch.zeros(shape, device=gen.device)
        full = torch.empty(shape, device=gen.device).normal_(0.0, self.config.initializer_range, generator=gen)
        if name == "model.embed_tokens.weight" and self.config.pad_token_id is not None:
            full[self.config.pad_token_id] = 0
        return full

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        if hf.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_path holds a '{hf.get('model_type')}' model, not {cls.model_type}")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"HF config has {key}=true; Galaxy's {cls.hf_architecture} has no such biases")
        hf = dict(cls.hf_defaults, **hf)
        if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
            raise ValueError(f"HF config has head_dim={hf['head_dim']} but Galaxy derives it as "
                             "hidden_size / num_attention_heads")
        # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_scaling` + `rope_theta`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"HF config uses rope type '{kind}'; supported: {', '.join(ROPE_TYPES)}")
        cfg = ModelConfig(model_type=cls.model_type, qkv_bias=cls.qkv_bias, **{k: hf[k] for k in HF_KEYS if k in hf})
        cfg.num_key_value_heads = hf.get("num_key_value_heads") or cfg.num_attention_heads
        cfg.rope_theta = float(theta)
        cfg.rope_scaling = None if kind == "default" else dict(rope, rope_type=kind)
        cfg.pad_token_id = hf.get("pad_token_id")  # HF LLaMA usually has none: no padding row
        cfg.hidden_dropout_prob = 0.0
        cfg.attention_probs_dropout_prob = float(hf.get("attention_dropout", 0.0))
        return cfg

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        c = cls.own_config(config)
        if c.qkv_bias != cls.qkv_bias:
            raise ConfigError(f"config key 'qkv_bias' is {c.qkv_bias}, but HF's {cls.hf_architecture} "
                              f"{'always' if cls.qkv_bias else 'never'} has q/k/v biases; it has no HF form")
        hf = {k: getattr(c, k) for k in HF_KEYS}
        rope_parameters = dict(c.rope_scaling or {}, rope_theta=c.rope_theta)
        rope_parameters["rope_type"] = rope_parameters.pop("type", rope_parameters.get("rope_type", "default"))
        hf.update(model_type=cls.model_type, architectures=[cls.hf_architecture], num_key_value_heads=c.kv_heads,
                  head_dim=c.head_dim, attention_bias=False, mlp_bias=False,
                  attention_dropout=c.attention_probs_dropout_prob, pad_token_id=c.pad_token_id,
                  # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta/rope_scaling.
                  rope_parameters=rope_parameters, rope_theta=c.rope_theta,
                  rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None)
        if dtype is not None:
            hf["dtype"] = str(dtype).removeprefix("torch.")
        return hf

    def config_to_hf(self) -> dict:
        return dict(super().config_to_hf(), **self.special_token_ids)

    def loaded_from(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        self.special_token_ids = {k: hf[k] for k in SPECIAL_TOKEN_KEYS if k in hf}
        c = self.config
        logger.info("loaded %s from %s: %d layers, %d query / %d key-value heads, rope %s, plan %s", self.model_type,
                    path, c.num_hidden_layers, c.num_attention_heads, c.kv_heads,
                    (c.rope_scaling or {}).get("rope_type", "default"), self.plan.name)
