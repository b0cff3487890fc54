"""Shared by the planner's tests: tiny BERT / LLaMA model sections, and a synthetic cluster profile whose
piece times are linear in size over each rank's speed (known terms, so predictions can be derived by hand)."""

from galaxy.config import GalaxyConfig, Method
from galaxy.planner.blocks import grid
from galaxy.planner.cluster import (OPS, PIECES, AlphaBeta, ClusterProfile, Curve, Piece, RankProfile,
                                    candidate_groups)

TP, SP, NONE = Method.TP, Method.SP, Method.NONE

BERT = {"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 128, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 48, "hidden_act": "silu", "pad_token_id": None,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 128}


def model_config(raw):
    seq = raw.get("max_position_embeddings", 128)
    return GalaxyConfig.from_dict({"model": raw, "train": {"seq_length": seq}}).model


def synthetic_cluster(model_raw, world, speeds, seq=8, rows=2, alpha=2e-4, beta=1e-8, memory=2**30, waited=None):
    """Per-rank piece times linear in size, divided by the rank's speed; one alpha-beta for all groups.
    ``waited``: the members that waited leave an all-gather at that fraction of its time (as over Gloo)."""
    m = model_config(model_raw)
    sizes = {"heads": grid(m.num_attention_heads, m.num_attention_heads // m.kv_heads),
             "tokens": grid(seq), "ffn": grid(m.intermediate_size)}
    cost = {"att_proj": 3e-4, "att_core": 5e-4, "mlp": 8e-4, "con": 1e-4, "head": 6e-4}
    full = {"heads": m.num_attention_heads, "tokens": seq, "ffn": m.intermediate_size}
    ranks = []
    for r, speed in enumerate(speeds):
        pieces = {}
        for name in PIECES:
            kind, by = name.split(".")
            xs = tuple(sizes[by])
            fwd = tuple((2e-5 + cost[kind] * x / full[by]) / speed for x in xs)
            pieces[name] = Piece(Curve(xs, fwd), Curve(xs, tuple(2 * v for v in fwd)),
                                 Curve(xs, tuple(1000.0 * x for x in xs)))
        ranks.append(RankProfile(r, "host", memory, {rows: pieces}, AlphaBeta(1e-4, 1e-9 / speed)))
    groups = {g: {op: AlphaBeta(alpha, beta) for op in OPS} for g in candidate_groups(world)}
    early = {} if waited is None else {g: {**ops, "all_gather": AlphaBeta(alpha * waited, beta * waited)}
                                       for g, ops in groups.items()}
    return ClusterProfile(world, "gloo", "cpu", m, (rows,), seq, "float32", tuple(ranks), groups, early)


PLANS = [("bert", (TP, NONE, TP), [3, 1], [40, 24], [8, 8]),
         ("bert", (TP, SP, TP), [1, 3], [24, 40], [11, 5]),
         ("bert", (SP, SP, SP), [2, 2], [32, 32], [6, 10]),
         ("bert", (TP, SP, SP), [3, 1], [32, 32], [9, 7]),
         ("bert", (SP, NONE, TP), [2, 2], [40, 24], [8, 8]),
         ("llama", (SP, SP, TP), [4, 4], [20, 28], [10, 6]),
         ("llama", (TP, NONE, SP), [4, 4], [24, 24], [7, 9])]
