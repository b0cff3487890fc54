"""The BERT family to the rest of the house (``galaxy.models.family``): its facts, the shapes the
planner's cost model reads, the block probes it times, and its side network."""

from __future__ import annotations

import torch
import torch.nn as nn

from galaxy.config import Method, ModelConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.core.layers import Dropout
from galaxy.models.base import GalaxyModel, LayerParameters
from galaxy.models.bert.model import (BertEmbeddings, BertForMaskedLM, BertForSequenceClassification, BertIntermediate,
                                      BertLayer, BertOnlyMLMHead, BertOutput, BertSelfAttention, BertSelfOutput,
                                      LayerNorm)
from galaxy.models.family import Family

# ----------------------------------------------------------------------------- planner probes


class BertQKV(nn.Module):
    """ATT's q/k/v projections (the planner's ``att_proj`` piece)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.attn = BertSelfAttention(cfg, plan, ctx)

    def forward(self, x):
        return self.attn.query(x), self.attn.key(x), self.attn.value(x)


class BertMLP(nn.Module):
    """MLP's two linears and the activation (the planner's ``mlp`` piece)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.intermediate, self.output = BertIntermediate(cfg, plan, ctx), BertOutput(cfg, plan, ctx)

    def forward(self, x):
        return self.output.dense(self.intermediate.activate(self.intermediate.dense(x)))


class BertCon(nn.Module):
    """CON: dropout, residual add, LayerNorm (post-LN)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.kernels)
        self.dropout = Dropout(cfg.hidden_dropout_prob, ctx.generator(sharded=plan.con == Method.SP))

    def forward(self, a, h):
        return self.norm(self.dropout(a) + h)


class BertEmbeddingsAndHead(nn.Module):
    """The embeddings and the MLM head with its tied decoder."""

    def __init__(self, cfg: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg, plan, ctx)
        self.head = BertOnlyMLMHead(cfg, plan, self.embeddings.word_embeddings)

    def forward(self, ids):
        return self.head(self.embeddings(ids, torch.zeros_like(ids), 0))


# ----------------------------------------------------------------------------- the family


class BertFamily(Family):
    classes = {"lm": BertForMaskedLM, "classify": BertForSequenceClassification}
    tiny_config = dict(preset="bert-tiny")
    lora_targets = ("query", "value")
    # The outputs of ATT and MLP after their dropout, before ``LayerNorm(. + h)``.
    adapter_points = {"attn": r"(.+\.)?layer\.\d+\.attention\.output\.dropout",
                      "mlp": r"(.+\.)?layer\.\d+\.output\.dropout"}

    def matmul_weights(self, cfg: ModelConfig, task: str = "lm") -> tuple[int, int]:
        h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        return 4 * h * h + 2 * h * i, 0 if task == "classify" else h * h + h * v  # MLM transform + decoder

    def layer_parameters(self, cfg: ModelConfig, heads, ffn) -> LayerParameters:
        h, d = cfg.hidden_size, cfg.head_dim
        return LayerParameters(att_sharded=3 * (heads * d * h + heads * d) + h * heads * d,  # q, k, v + biases; dense
                               att_row_bias=h, mlp_sharded=ffn * h + ffn + h * ffn, mlp_row_bias=h,
                               con=2 * 2 * h)  # two LayerNorms

    def edge_parameters(self, cfg: ModelConfig) -> tuple[int, int]:
        h, v = cfg.hidden_size, cfg.vocab_size
        emb = v * h + cfg.max_position_embeddings * h + cfg.type_vocab_size * h + 2 * h
        head = h * h + h + 2 * h + v  # transform dense, its LayerNorm, the decoder bias (weight tied)
        return emb, head

    def ties_embeddings(self, cfg: ModelConfig) -> bool:
        return True  # the MLM decoder is the word embeddings

    def att_proj_probe(self, cfg, plan, ctx, seq):
        return BertQKV(cfg, plan, ctx)

    def att_out_probe(self, cfg, plan, ctx):
        return BertSelfOutput(cfg, plan, ctx).dense

    def mlp_probe(self, cfg, plan, ctx):
        return BertMLP(cfg, plan, ctx)

    def con_probe(self, cfg, plan, ctx):
        return BertCon(cfg, plan, ctx)

    def head_probe(self, cfg, plan, ctx):
        return BertEmbeddingsAndHead(cfg, plan, ctx)

    def side_spec(self, model: GalaxyModel, side_cfg: ModelConfig, side_plan: Plan):
        from galaxy.adapters.side import SideSpec

        layers = list(model.bert.encoder.layer)
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # trainable: fp32 masters
        with torch.device(model.ctx.device):
            side_layers = [BertLayer(side_cfg, side_plan, model.ctx).to(dtype) for _ in layers]
        return SideSpec(model.bert, layers, side_layers, model.config.hidden_size, side_cfg.hidden_size,
                        run_layer=lambda layer, s, call: layer(s, call["attention_mask"]),
                        init_full=model._init_full)


BERT = BertFamily()
