"""What a plan moves and holds, from the model's shapes alone: the collectives of each layout
transition (docs/design.md's table) and each rank's parameters by gradient rule.

Arrays broadcast: a split may be a number or an array of candidate splits ``[candidates, ranks]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from galaxy.config import Method, ModelConfig
from galaxy.models import family

LAYOUTS = {Method.TP: ("T", "P"), Method.SP: ("S", "S"), Method.NONE: ("R", "R")}


def stream_layout(con: Method) -> str:
    """The residual stream lives in CON's layout."""
    return LAYOUTS[con][1]


@dataclass(frozen=True)
class ParamCounts:
    """Trainable parameters held by each rank, those whose gradient is summed over the mp group, and of those
    the matrices of SP blocks (the replicated weights ``mp_grad_reduce: fsdp`` shards over mp; their column
    biases counted with them, as the cost model counts FSDP's other vectors)."""

    total: np.ndarray
    partial: np.ndarray
    replicated: np.ndarray


def layer_params(m: ModelConfig, att: Method, mlp: Method, con: Method, heads, ffn) -> ParamCounts:
    """One transformer layer on a rank holding ``heads`` query heads (ATT.tp) and ``ffn`` columns (MLP.tp)."""
    H, F = m.num_attention_heads, m.intermediate_size
    nh = np.asarray(heads, dtype=np.int64) if att == Method.TP else H
    nf = np.asarray(ffn, dtype=np.int64) if mlp == Method.TP else F
    p = family(m.model_type).layer_parameters(m, nh, nf)
    zero = np.zeros_like(np.asarray(heads) + np.asarray(ffn), dtype=np.int64)
    total = zero + p.att_sharded + p.att_row_bias + p.mlp_sharded + p.mlp_row_bias + p.con
    partial, replicated = zero.copy(), zero.copy()
    for method, sharded, row_bias in ((att, p.att_sharded, p.att_row_bias), (mlp, p.mlp_sharded, p.mlp_row_bias)):
        if method == Method.SP:
            partial = partial + sharded + row_bias
            replicated = replicated + sharded
        elif method == Method.TP:
            partial = partial + row_bias  # a row-parallel bias is added on one rank only
    if con == Method.SP:
        partial = partial + p.con
    return ParamCounts(total, partial, replicated)


def edge_params(m: ModelConfig) -> tuple[int, int]:
    """(first stage's embeddings, last stage's head) parameters, without the tied decoder weight."""
    return family(m.model_type).edge_parameters(m)


def tied_params(m: ModelConfig) -> int:
    """Parameters of the embedding matrix the head reads too (two pipeline stages sum its gradient)."""
    return m.vocab_size * m.hidden_size if family(m.model_type).ties_embeddings(m) else 0
