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
which receives the local queries' indices into the sequence in the stream's order (SP included; the
tables are built from the position ids in that order: causal ring attention's zigzag,
``galaxy.core.sp_attention``), so one cos/sin table per forward serves every plan. A KV cache
(``past_key_values``/``use_cache``) serves ``model.generate`` (``galaxy.models.generation``) on every
plan: the cache holds the whole sequence of each rank's heads (ATT.sp gathers K and V in the prefill, in
the natural order, as the allgather flavour does), the layers run eagerly on plain edges, and under SP
the steps after the prefill run their new tokens replicated (``LlamaModel.decode_edges``).

Options of how it computes (``ModelConfig``): ``fused_gate_up`` holds gate and up as one
``mlp.gate_up_proj.weight`` ``[2, intermediate, hidden]`` (one matmul; HF checkpoints are
converted both ways by ``galaxy.models.llama.hf``); ``kernels`` runs RMSNorm, RoPE, SwiGLU and the
head with its loss on the Triton kernels of ``galaxy.kernels``.

Under pipeline parallelism (``ctx.pp.size > 1``) a model is one stage (``galaxy.core.pipeline``):
``model.layers.i`` under their global indices, ``embed_tokens`` on the first stage, the final
norm and ``lm_head`` on the last. With tied embeddings the last stage holds its own copy of
``model.embed_tokens`` for the head; the two copies' gradients are summed after backward.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.config import ConfigError, Method, ModelConfig, Plan
from galaxy.core.attention import attention
from galaxy.core.blocks import merge_heads, self_attention, split_heads
from galaxy.core.context import ParallelContext
from galaxy.core.edges import Edge, LayerEdges, Stream, in_compute_dtype
from galaxy.core.grad_sync import mark_pipeline_tie
from galaxy.core.layers import Dropout, GradRule, ParallelLinear, StackedLinear, mark_module, region_rule
from galaxy.core.parallelize import TransformerLayer
from galaxy.core.pipeline import StageSpec, layer_stack
from galaxy.core.recompute import recomputed_when_compiled
from galaxy.core.sp_attention import gather_kv, stream_order
from galaxy.core.transitions import reduce_to_replicated
from galaxy.kernels import apply_rope, fused_linear_cross_entropy, rms_norm, swiglu, swiglu_packed
from galaxy.kernels.fp8 import logits_on_fp8
from galaxy.models.base import (GalaxyModel, ModelOutput, activation, at_least_fp32, default_plan_and_context, plain,
                                token_loss_sum, use_triton)
from galaxy.models.generation import generate
from galaxy.models.llama.hf import ROPE_TYPES, LlamaHF

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


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
    sequence the tables were built for (positions in the stream's order under SP), so each rank rotates its
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
    """GQA: under ATT.tp this rank's ``heads_split[rank]`` query heads and their key/value heads, whole
    otherwise; the query, key and value projections are ``project_in``'s (a variant fuses them). No
    ``forward``: the block's edges call the projections, and FSDP gathers in the forward hooks of the
    modules called, so the projections are the units (``galaxy.core.fsdp``)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, layer_idx: int):
        super().__init__()
        rank, h, d = ctx.mp.rank, cfg.hidden_size, cfg.head_dim
        self.group = cfg.num_attention_heads // cfg.kv_heads
        self.layer_idx, self.head_dim = layer_idx, d
        self.num_heads = plan.heads_split[rank] if plan.att == Method.TP else cfg.num_attention_heads
        self.num_kv_heads = self.num_heads // self.group
        self.project_in(cfg, plan, rank)
        q_split = [n * d for n in plan.heads_split]
        self.o_proj = ParallelLinear.for_method(plan.att, cfg.num_attention_heads * d, h, False, "row", q_split, rank)
        self.dropout = Dropout(cfg.attention_probs_dropout_prob, ctx.generator(sharded=plan.att != Method.NONE))

    def project_in(self, cfg: ModelConfig, plan: Plan, rank: int) -> None:
        """``q_proj``, ``k_proj`` and ``v_proj``, their columns split by heads under ATT.tp."""
        h, d = cfg.hidden_size, cfg.head_dim
        q_split = [n * d for n in plan.heads_split]
        kv_split = [n // self.group * d for n in plan.heads_split]
        bias = bool(cfg.qkv_bias)  # column-parallel biases are sharded with their columns
        self.q_proj = ParallelLinear.for_method(plan.att, h, cfg.num_attention_heads * d, bias, "column", q_split, rank)
        self.k_proj = ParallelLinear.for_method(plan.att, h, cfg.kv_heads * d, bias, "column", kv_split, rank)
        self.v_proj = ParallelLinear.for_method(plan.att, h, cfg.kv_heads * d, bias, "column", kv_split, rank)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edge: Edge, key_padding_mask,
               rope: RopeAt, cache: Optional[KVCache] = None, core=attention) -> torch.Tensor:
        """Causal attention of the projections in the block's layout (``edge``), the output projection's input."""
        if cache is not None:
            return self.cached(q, k, v, edge, key_padding_mask, rope, cache)
        return self_attention(q, k, v, shard=edge.shard, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                              head_dim=self.head_dim, key_padding_mask=key_padding_mask, causal=True,
                              dropout=self.dropout, rope=rope, core=core)

    def cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edge: Edge, key_padding_mask,
               rope: RopeAt, cache: KVCache) -> torch.Tensor:
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
            k, v = gather_kv(k, v, edge.shard.comm, edge.shard.split)
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
    attention_class = LlamaAttention

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, layer_idx: int):
        super().__init__(ctx.mp, plan)
        self.self_attn = self.attention_class(cfg, plan, ctx, layer_idx)
        self.mlp = LlamaMLP(cfg, plan, ctx)
        self.input_layernorm = _norm(cfg, plan)
        self.post_attention_layernorm = _norm(cfg, plan)
        # HF LLaMA has no residual dropout; hidden_dropout_prob (0 in every preset) adds one in CON,
        # a module per residual add so adapters can be injected after each by name.
        generator = ctx.generator(sharded=plan.con == Method.SP)
        self.attn_dropout = Dropout(cfg.hidden_dropout_prob, generator)
        self.mlp_dropout = Dropout(cfg.hidden_dropout_prob, generator)

    def mlp_modules(self) -> list[nn.Module]:
        return [self.mlp]

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
        a = attn.attend(q, k, v, att_edge, key_padding_mask, rope, cache, self.attention_core)
        h = h + self.attn_dropout(att_edge.leave(a, attn.o_proj))
        x = recomputed_when_compiled(block_input, self.post_attention_layernorm, h)
        return h + self.mlp_dropout(mlp_edge.run(self.mlp, x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, stage: Optional[StageSpec] = None,
                 layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer):
        super().__init__()
        self.cfg, self.plan, self.ctx = cfg, plan, ctx
        self.stage = stage = stage or StageSpec.whole(cfg.num_hidden_layers)
        # Causal ring attention runs the stream in the load-balanced zigzag order (galaxy.core.sp_attention);
        # the KV cache's prefill gathers K and V (allgather) in the natural order.
        self.stream = Stream(ctx.mp, plan, stream_order(plan, causal=True))
        # Generation runs plain edges: the prefill's on the plan, and after an SP prefill the new tokens
        # replicated on every rank, SP blocks (whose weights are whole) computing them as 'none' blocks
        # do, TP blocks keeping their shards.
        decode_plan = replace(plan, **{block: Method.NONE for block in ("att", "con", "mlp")
                                       if getattr(plan, block) == Method.SP})
        self.prefill_edges, self.prefill_stream = LayerEdges.plain(ctx.mp, plan), Stream(ctx.mp, plan)
        self.decode_edges, self.decode_stream = LayerEdges.plain(ctx.mp, decode_plan), Stream(ctx.mp, decode_plan)
        tied = cfg.tie_word_embeddings and not stage.is_whole
        if stage.is_first or (tied and stage.is_last):
            self.embed_tokens = mark_module(nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                                         padding_idx=cfg.pad_token_id), region_rule(plan.con))
            if tied:
                mark_pipeline_tie(self.embed_tokens.weight, "embed_tokens", copy=not stage.is_first)
        else:
            self.embed_tokens = None
        self.layers = layer_stack((layer_class(cfg, plan, ctx, i) for i in stage.layers), stage.first_layer)
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
        stream = self.decode_stream if past else self.stream if cache is None else self.prefill_stream
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
        rope = RopeAt(*self.rotary_emb(stream.order.to_stream_order(position_ids), h.dtype), self.cfg.kernels)
        for layer in self.layers:
            h = layer(h, attention_mask, rope, cache, edges)
        return self.norm(h) if self.stage.is_last else h


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


# ----------------------------------------------------------------------------- the model


class LlamaForCausalLM(LlamaHF, GalaxyModel):
    model_type = "llama"
    hf_architecture = "LlamaForCausalLM"
    gate_up_fusable = True
    decoder_layer = LlamaDecoderLayer  # a variant with other projections builds its own layers

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
            self.model = LlamaModel(config, plan, ctx, self.stage, self.decoder_layer)
            if not self.stage.is_last:
                self.lm_head = None
            elif config.tie_word_embeddings:
                self.lm_head = TiedLMHead(self.model.embed_tokens)
            else:
                # The head runs on the stream's (local) tokens: whole weight, CON's rule.
                self.lm_head = ParallelLinear(config.hidden_size, config.vocab_size, bias=False,
                                              rule=region_rule(plan.con))
        # The frozen head's row-wise e4m3 copy when its logits run on fp8 (galaxy.loralib.quantized.quantize_head)
        self.lm_head_fp8: Optional[nn.Module] = None
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
        head_fp8 = None if self.lm_head_fp8 is None else self.lm_head_fp8.matrix()
        if fused:
            logits = None
        else:
            logits = self.lm_head(h) if head_fp8 is None else logits_on_fp8(h, self.lm_head.weight, head_fp8,
                                                                            self.config.kernels)
        loss = None
        if labels is not None:
            # Position t predicts labels[t + 1]: shift the full labels first, then take this rank's
            # slice, so every shard scores its own logits and nothing gathers the full logits.
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            count = (shifted != IGNORE_INDEX).sum().clamp(min=1)
            local = self.model.stream.to_stream(shifted)
            if fused:
                loss = fused_linear_cross_entropy(h, self.lm_head.weight, local, IGNORE_INDEX, "mean",
                                                  num_targets=count, backend="triton", weight_fp8=head_fp8)
            else:
                loss = token_loss_sum(logits, local, count, self.config.kernels, IGNORE_INDEX)
            if self.model.stream.sharded:
                loss = reduce_to_replicated(loss, self.ctx.mp)  # per-rank sums are partial
        return CausalLMOutput(loss=loss, logits=logits, hidden_states=h, past_key_values=cache)

    # -- init (HF LlamaPreTrainedModel's; HF names and layouts: ``LlamaHF``)

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
