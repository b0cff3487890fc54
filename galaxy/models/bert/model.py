"""BERT (post-LN) with the module tree and parameter names of HF ``BertModel``, on any plan.

A layer is the chain ATT -> CON1 -> MLP -> CON2. Each block runs the method the plan gives it
(``ParallelLinear.for_method`` picks whole / column / row weights), the residual stream lives in
CON's layout, and each block meets it through its edges (``galaxy.core.edges``); how the edges run,
what is recomputed and what is compiled is set from outside (``galaxy.core.parallelize``).

``kernels`` picks the Triton kernels of ``galaxy.kernels`` for the MLM decoder with its loss (and, only
when 'triton' is asked for, LayerNorm).

Under pipeline parallelism (``ctx.pp.size > 1``) a model is one stage (``galaxy.core.pipeline``):
it holds its range of ``bert.encoder.layer.i`` under their global indices, the embeddings on the
first stage and the head on the last. The MLM decoder is tied to the word embeddings, so the last
stage holds its own copy of ``bert.embeddings.word_embeddings`` (same name, same init) whose
gradient is summed with the first stage's after backward. A stage's ``forward`` takes the previous
stage's output as ``hidden_states`` and returns its own (``ModelOutput.hidden_states``) unless it
is the last, which returns the loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.config import Method, ModelConfig, Plan
from galaxy.core.blocks import self_attention
from galaxy.core.context import ParallelContext
from galaxy.core.edges import Edge, Stream, in_compute_dtype
from galaxy.core.grad_sync import mark_pipeline_tie
from galaxy.core.layers import Dropout, GradRule, ParallelLinear, mark_module, region_rule
from galaxy.core.parallelize import TransformerLayer
from galaxy.core.pipeline import StageSpec, layer_stack
from galaxy.core.recompute import recomputed_when_compiled
from galaxy.core.transitions import reduce_to_replicated
from galaxy.kernels import fused_linear_cross_entropy, layer_norm
from galaxy.models.base import (GalaxyModel, ModelOutput, activation, at_least_fp32, default_plan_and_context, plain,
                                token_loss_sum, use_triton)
from galaxy.models.bert.hf import BertHF

class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, names and class name, which profiles report) that runs the
    Triton kernel where ``kernels`` asks for it ('auto': where the measured table picks it; never inside
    a torch.compile graph, see ``use_triton``). Under autocast both return fp32 over fp32 weights."""

    def __init__(self, hidden_size: int, eps: float, kernels: str = "auto"):
        super().__init__(hidden_size, eps=eps)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(self.kernels, x, "layer_norm"):
            return layer_norm(x, self.weight, self.bias, self.eps, backend="triton")
        return super().forward(x)


def _layer_norm(cfg: ModelConfig, method: Method) -> nn.LayerNorm:
    return mark_module(LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.kernels), region_rule(method))


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout: computed in CON's layout."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        for emb in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings):
            mark_module(emb, region_rule(plan.con))
        self.LayerNorm = _layer_norm(cfg, plan.con)
        self.dropout = Dropout(cfg.hidden_dropout_prob, ctx.generator(sharded=plan.con == Method.SP))

    def forward(self, input_ids, token_type_ids, position_offset: int):
        positions = torch.arange(position_offset, position_offset + input_ids.shape[1], device=input_ids.device)
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None] \
            + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(h))


class BertWordEmbeddings(nn.Module):
    """The last pipeline stage's copy of the word embeddings, for the tied MLM decoder."""

    def __init__(self, cfg: ModelConfig, plan: Plan):
        super().__init__()
        self.word_embeddings = mark_module(nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id),
                                           region_rule(plan.con))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        rank, h, d = ctx.mp.rank, cfg.hidden_size, cfg.head_dim
        self.num_heads = plan.heads_split[rank] if plan.att == Method.TP else cfg.num_attention_heads
        split = [n * d for n in plan.heads_split]
        for name in ("query", "key", "value"):
            setattr(self, name, ParallelLinear.for_method(plan.att, h, h, True, "column", split, rank))
        self.dropout = Dropout(cfg.attention_probs_dropout_prob, ctx.generator(sharded=plan.att != Method.NONE))


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        split = [n * cfg.head_dim for n in plan.heads_split]
        self.dense = ParallelLinear.for_method(plan.att, cfg.hidden_size, cfg.hidden_size, True, "row", split,
                                               ctx.mp.rank)
        self.LayerNorm = _layer_norm(cfg, plan.con)
        self.dropout = Dropout(cfg.hidden_dropout_prob, ctx.generator(sharded=plan.con == Method.SP))


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.self = BertSelfAttention(cfg, plan, ctx)
        self.output = BertSelfOutput(cfg, plan, ctx)


class BertIntermediate(nn.Module):
    """The MLP's first dense (the MLP block's entry edge calls it) and the activation. No ``forward``: FSDP
    gathers in the forward hooks of the modules called, so the dense is the unit (``galaxy.core.fsdp``)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.dense = ParallelLinear.for_method(plan.mlp, cfg.hidden_size, cfg.intermediate_size, True, "column",
                                               plan.ffn_split, ctx.mp.rank)
        self.act = activation(cfg.hidden_act)

    def activate(self, i: torch.Tensor) -> torch.Tensor:
        # Compiled, backward rebuilds the output dense's weight-gradient input from i (which the activation's
        # own backward keeps) instead of keeping both.
        return recomputed_when_compiled(self.act, i)


def normed_and_block_input(norm: nn.LayerNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-LN's ``norm(x)`` (the residual stream) and its copy in the compute dtype (the next block's input).
    Made together so that a compiled layer rebuilds the copy in backward with the norm
    (``recomputed_when_compiled``), from ``x``, which the norm's backward keeps, instead of keeping it: under
    autocast over fp32 weights that copy is what the MLP's first dense keeps for its weight gradient."""
    y = norm(x)
    return y, in_compute_dtype(y)


class BertOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.dense = ParallelLinear.for_method(plan.mlp, cfg.intermediate_size, cfg.hidden_size, True, "row",
                                               plan.ffn_split, ctx.mp.rank)
        self.LayerNorm = _layer_norm(cfg, plan.con)
        self.dropout = Dropout(cfg.hidden_dropout_prob, ctx.generator(sharded=plan.con == Method.SP))


class BertLayer(TransformerLayer):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__(ctx.mp, plan)
        self.head_dim = cfg.head_dim
        self.attention = BertAttention(cfg, plan, ctx)
        self.intermediate = BertIntermediate(cfg, plan, ctx)
        self.output = BertOutput(cfg, plan, ctx)

    def mlp_modules(self) -> list[nn.Module]:
        return [self.intermediate, self.output.dense]

    def mlp(self, x: torch.Tensor, edge: Edge) -> torch.Tensor:
        """The MLP block between its edges: dense, activation, dense (its residual and LayerNorm are CON's)."""
        (i,) = edge.enter(x, [self.intermediate.dense])
        return edge.leave(self.intermediate.activate(i), self.output.dense)

    def compute(self, h: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        att_edge, mlp_edge = self.edges
        q_k_v, out = self.attention.self, self.attention.output
        # ATT
        q, k, v = att_edge.enter(h, [q_k_v.query, q_k_v.key, q_k_v.value])
        a = self_attention(q, k, v, shard=att_edge.shard, num_heads=q_k_v.num_heads, num_kv_heads=q_k_v.num_heads,
                           head_dim=self.head_dim, key_padding_mask=key_padding_mask, dropout=q_k_v.dropout,
                           core=self.attention_core)
        a = att_edge.leave(a, out.dense)
        # CON1
        h, x = recomputed_when_compiled(normed_and_block_input, out.LayerNorm, out.dropout(a) + h)
        # MLP, CON2
        return self.output.LayerNorm(self.output.dropout(mlp_edge.run(self.mlp, x)) + h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, layers: Optional[range] = None):
        super().__init__()
        layers = range(cfg.num_hidden_layers) if layers is None else layers
        self.layer = layer_stack((BertLayer(cfg, plan, ctx) for _ in layers), layers.start)

    def forward(self, h, key_padding_mask):
        for layer in self.layer:
            h = layer(h, key_padding_mask)
        return h


class BertPooler(nn.Module):
    """Dense + tanh on the first token; runs replicated on every rank."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = ParallelLinear(cfg.hidden_size, cfg.hidden_size, rule=GradRule.REPLICATED)

    def forward(self, first_token):
        return torch.tanh(self.dense(first_token))


class BertModel(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext, add_pooling_layer: bool = True,
                 stage: Optional[StageSpec] = None, tied_word_embeddings: bool = False):
        """``stage``: the pipeline stage to build (None: the whole model); ``tied_word_embeddings``:
        the head reads the word embeddings, so a last stage without them holds a tied copy."""
        super().__init__()
        self.cfg, self.plan, self.ctx = cfg, plan, ctx
        self.stage = stage = stage or StageSpec.whole(cfg.num_hidden_layers)
        self.stream = Stream(ctx.mp, plan)
        if stage.is_first:
            self.embeddings = BertEmbeddings(cfg, plan, ctx)
        elif stage.is_last and tied_word_embeddings:
            self.embeddings = BertWordEmbeddings(cfg, plan)
        else:
            self.embeddings = None
        if tied_word_embeddings and not stage.is_whole and self.embeddings is not None:
            mark_pipeline_tie(self.embeddings.word_embeddings.weight, "word_embeddings", copy=not stage.is_first)
        self.encoder = BertEncoder(cfg, plan, ctx, stage.layers)
        self.pooler = BertPooler(cfg) if add_pooling_layer and stage.is_last else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, hidden_states=None) -> torch.Tensor:
        """Hidden states of the last layer in the stream's layout (this rank's tokens under CON.sp).
        A pipeline stage after the first starts from ``hidden_states``, the previous stage's output."""
        if not self.stage.is_first:
            if hidden_states is None:
                raise ValueError(f"pipeline stage {self.stage.index} starts at layer {self.stage.first_layer}: "
                                 "pass the previous stage's output as hidden_states")
            return self.encoder(hidden_states, attention_mask)
        uses_seq = Method.SP in (self.plan.att, self.plan.con, self.plan.mlp) and self.ctx.mp.size > 1
        if uses_seq and input_ids.shape[1] != sum(self.plan.seq_split):
            raise ValueError(f"input has {input_ids.shape[1]} tokens but the plan splits {sum(self.plan.seq_split)} "
                             f"(seq_scatter_list {list(self.plan.seq_split)}); pad inputs to seq_length")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = self.embeddings(self.stream.to_stream(input_ids), self.stream.to_stream(token_type_ids),
                            self.stream.offset())
        return self.encoder(h, attention_mask)

    def first_token(self, h: torch.Tensor) -> torch.Tensor:
        """The [CLS] hidden state, replicated: under CON.sp only the first shard holds it, so the
        others contribute zeros to a partial tensor that one all-reduce makes whole. The zeros are
        ``0 * h`` rather than fresh ones so every rank's backward still runs through the layers
        and meets the same collectives."""
        if not self.stream.sharded:
            return h[:, 0]
        first = h[:, 0] if self.stream.offset() == 0 else h[:, 0] * 0
        return reduce_to_replicated(first, self.ctx.mp)


    def mean_token(self, h: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The mean hidden state over each row's real tokens, replicated: under CON.sp every rank sums
        its own tokens and one all-reduce adds the partial sums."""
        b, s = h.shape[0], h.shape[1]
        offset = self.stream.offset()
        mask = attention_mask if attention_mask is not None else h.new_ones(b, offset + s)
        local = mask[:, offset:offset + s].to(h.dtype).unsqueeze(-1)
        total = (h * local).sum(dim=1)
        if self.stream.sharded:
            total = reduce_to_replicated(total, self.ctx.mp)
        return total / mask.sum(dim=1, keepdim=True).clamp(min=1).to(h.dtype)

    def pooled(self, h: torch.Tensor, attention_mask: Optional[torch.Tensor], pooling: str) -> torch.Tensor:
        return self.pooler(self.first_token(h) if pooling == "cls" else self.mean_token(h, attention_mask))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan):
        super().__init__()
        self.dense = ParallelLinear(cfg.hidden_size, cfg.hidden_size, rule=region_rule(plan.con))
        self.act = activation(cfg.hidden_act)
        self.LayerNorm = _layer_norm(cfg, plan.con)

    def forward(self, h):
        return self.LayerNorm(self.act(self.dense(h)))


class BertLMPredictionHead(nn.Module):
    """Transform, then the decoder tied to the word embeddings, plus its own bias."""

    def __init__(self, cfg: ModelConfig, plan: Plan, word_embeddings: nn.Embedding):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg, plan)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        mark_module(self, region_rule(plan.con))
        self.word_embeddings = [word_embeddings]  # a list keeps the tied module out of this subtree

    def forward(self, h):
        return F.linear(self.transform(h), self.word_embeddings[0].weight, self.bias)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Plan, word_embeddings: nn.Embedding):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, plan, word_embeddings)

    def forward(self, h):
        return self.predictions(h)


# ----------------------------------------------------------------------------- the models


class BertPreTrainedModel(BertHF, GalaxyModel):
    """What BERT's heads share: the encoder's init (HF conversion: ``BertHF``)."""

    model_type = "bert"

    def _init_full(self, name: str, shape, gen: torch.Generator) -> torch.Tensor:
        # HF BertPreTrainedModel._init_weights: N(0, initializer_range) matrices and embeddings,
        # zero biases, unit LayerNorm scales, a zero padding row.
        leaf = name.rsplit(".", 1)[-1]
        if "LayerNorm" in name:
            return torch.ones(shape, device=gen.device) if leaf == "weight" else torch.zeros(shape, device=gen.device)
        if leaf == "bias":
            return torch.zeros(shape, device=gen.device)
        full = torch.empty(shape, device=gen.device).normal_(0.0, self.config.initializer_range, generator=gen)
        if name.endswith("word_embeddings.weight"):
            full[self.config.pad_token_id] = 0
        return full

    def _post_init(self, seed: int, meta: bool) -> None:
        if not meta:
            self.init_weights(seed)
        mark_module(self, GradRule.REPLICATED)
        self.parallelize()


class BertForMaskedLM(BertPreTrainedModel):
    hf_architecture = "BertForMaskedLM"
    tied_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                 "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def __init__(self, config: ModelConfig, plan: Optional[Plan] = None, ctx: Optional[ParallelContext] = None,
                 seed: int = 0, meta: bool = False):
        plan, ctx = default_plan_and_context(config, plan, ctx)
        super().__init__(config, plan, ctx)
        with self.parameter_device(meta):
            self.bert = BertModel(config, plan, ctx, add_pooling_layer=False, stage=self.stage,
                                  tied_word_embeddings=True)
            if self.stage.is_last:
                self.cls = BertOnlyMLMHead(config, plan, self.bert.embeddings.word_embeddings)
        self._post_init(seed, meta)

    @staticmethod
    def num_loss_targets(labels: torch.Tensor) -> torch.Tensor:
        """The loss is a sum over these targets divided by their count (the training loop weights
        micro-batches and dp shards by it, so their losses add up to the global-batch mean)."""
        return (labels != -100).sum()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                hidden_states=None) -> ModelOutput:
        h = self.bert(input_ids, attention_mask, token_type_ids, hidden_states)
        if not self.stage.is_last:
            return ModelOutput(hidden_states=h)
        # Training with Triton kernels: the tied decoder and the loss are one chunked kernel that never
        # holds the [tokens, vocab] logits (so none are returned), unless a hook wraps the head.
        head = self.cls.predictions
        fused = (labels is not None and self.training
                 and use_triton(self.config.kernels, h, "fused_linear_cross_entropy")
                 and plain(self.cls) and plain(head))
        logits = None if fused else self.cls(h)
        loss = None
        if labels is not None:
            # Sum over this rank's tokens, divided by the global count (labels are replicated),
            # so the per-rank losses are a partial tensor whose sum is the serial mean.
            count = (labels != -100).sum().clamp(min=1)
            local_labels = self.bert.stream.to_stream(labels)
            if fused:
                loss = fused_linear_cross_entropy(head.transform(h), head.word_embeddings[0].weight, local_labels,
                                                  -100, "mean", num_targets=count, bias=head.bias, backend="triton")
            else:
                loss = token_loss_sum(logits, local_labels, count, self.config.kernels)
            if self.bert.stream.sharded:
                loss = reduce_to_replicated(loss, self.ctx.mp)
        return ModelOutput(loss=loss, logits=logits, hidden_states=h)


class BertForSequenceClassification(BertPreTrainedModel):
    hf_architecture = "BertForSequenceClassification"
    fresh_for_task = ("classifier.", "bert.pooler.")

    def __init__(self, config: ModelConfig, plan: Optional[Plan] = None, ctx: Optional[ParallelContext] = None,
                 seed: int = 0, meta: bool = False):
        plan, ctx = default_plan_and_context(config, plan, ctx)
        super().__init__(config, plan, ctx)
        with self.parameter_device(meta):
            self.bert = BertModel(config, plan, ctx, add_pooling_layer=True, stage=self.stage)
            if self.stage.is_last:
                self.dropout = Dropout(config.hidden_dropout_prob, ctx.generator(sharded=False))
                self.classifier = ParallelLinear(config.hidden_size, config.num_labels, rule=GradRule.REPLICATED)
        self._post_init(seed, meta)

    @staticmethod
    def num_loss_targets(labels: torch.Tensor) -> torch.Tensor:
        """The loss is a mean over the rows (see ``BertForMaskedLM.num_loss_targets``)."""
        return torch.tensor(labels.shape[0])

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                hidden_states=None) -> ModelOutput:
        h = self.bert(input_ids, attention_mask, token_type_ids, hidden_states)
        if not self.stage.is_last:
            return ModelOutput(hidden_states=h)
        pooled = self.bert.pooled(h, attention_mask, self.config.classifier_pooling)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(at_least_fp32(logits).squeeze(-1), labels.to(at_least_fp32(logits).dtype))
            else:
                loss = F.cross_entropy(at_least_fp32(logits), labels)
        return ModelOutput(loss=loss, logits=logits, hidden_states=h)

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        hf = super().hf_config(config, dtype)
        if config.classifier_pooling != "cls":  # transformers' BERT ignores it and pools [CLS]
            hf["classifier_pooling"] = config.classifier_pooling
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(config.num_labels)}
        hf["label2id"] = {f"LABEL_{i}": i for i in range(config.num_labels)}
        return hf
