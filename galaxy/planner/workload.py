"""What a plan moves and holds, from the model's shapes alone: the collectives of each layout
transition (docs/design.md's table) and each rank's parameters by gradient rule.

Arrays broadcast: a split may be a number or an array of candidate splits ``[candidates, ranks]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from galaxy.config import Method, ModelConfig

LAYOUTS = {Method.TP: ("T", "P"), Method.SP: ("S", "S"), Method.NONE: ("R", "R")}


def stream_layout(con: Method) -> str:
    """The residual stream lives in CON's layout."""
    return LAYOUTS[con][1]


@dataclass(frozen=True)
class ParamCounts:
    """Trainable parameters held by each rank, and those whose gradient is summed over the mp group."""

    total: np.ndarray
    partial: np.ndarray


def layer_params(m: ModelConfig, att: Method, mlp: Method, con: Method, heads, ffn) -> ParamCounts:
    """One transformer layer on a rank holding ``heads`` query heads (ATT.tp) and ``ffn`` columns (MLP.tp)."""
    h, d, H, F = m.hidden_size, m.head_dim, m.num_attention_heads, m.intermediate_size
    bert = m.model_type == "bert"
    group = H // m.kv_heads
    nh = np.asarray(heads, dtype=np.int64) if att == Method.TP else H
    nf = np.asarray(ffn, dtype=np.int64) if mlp == Method.TP else F
    if bert:  # q, k, v with biases; dense (row) + its bias
        att_sharded = 3 * (nh * d * h + nh * d) + h * nh * d
        att_bias_row = h
        mlp_sharded = nf * h + nf + h * nf
        mlp_bias_row = h
        con_params = 2 * 2 * h  # two LayerNorms
    else:
        att_sharded = nh * d * h + 2 * (nh // group) * d * h + h * nh * d
        att_bias_row = 0
        mlp_sharded = 3 * nf * h
        mlp_bias_row = 0
        con_params = 2 * h  # two RMSNorms
    zero = np.zeros_like(np.asarray(heads) + np.asarray(ffn), dtype=np.int64)
    total = zero + att_sharded + att_bias_row + mlp_sharded + mlp_bias_row + con_params
    partial = zero.copy()
    for method, sharded, row_bias in ((att, att_sharded, att_bias_row), (mlp, mlp_sharded, mlp_bias_row)):
        if method == Method.SP:
            partial = partial + sharded + row_bias
        elif method == Method.TP:
            partial = partial + row_bias  # a row-parallel bias is added on one rank only
    if con == Method.SP:
        partial = partial + con_params
    return ParamCounts(total, partial)


def edge_params(m: ModelConfig) -> tuple[int, int]:
    """(first stage's embeddings, last stage's head) parameters, without the tied decoder weight."""
    h, v = m.hidden_size, m.vocab_size
    if m.model_type == "bert":
        emb = v * h + m.max_position_embeddings * h + m.type_vocab_size * h + 2 * h
        head = h * h + h + 2 * h + v  # transform dense, its LayerNorm, the decoder bias (weight tied)
    else:
        emb = v * h
        head = h + (0 if m.tie_word_embeddings else v * h)  # final norm + lm_head
    return emb, head
