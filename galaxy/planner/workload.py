"""What a plan computes, moves and holds, from the model's shapes alone: the workload and the layout
around the model-parallel group (``Workload``, ``Layout``), the candidate splits (``Splits``), the
collectives of each layout transition (docs/design.md's table) and each rank's parameters by gradient rule.

Arrays broadcast: a split may be a number or an array of candidate splits ``[candidates, ranks]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from galaxy.config import Method, ModelConfig, balanced_split
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


DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Layout:
    """How a world is used around the model-parallel group (training); latency uses the default."""

    dp: int = 1
    pp: int = 1
    microbatches: int = 1
    recompute: str = "none"  # none | full | selective | mlp (config key recompute)
    schedule: str = "1f1b"
    # one memory mode per model layer (config key layer_memory: a recompute mode, +offload); empty: recompute
    layer_memory: tuple[str, ...] = ()

    def stage_modes(self, stage_layers: list[int], p: int) -> list[str]:
        """The memory modes of pipeline stage ``p``'s layers (``stage_layers``: each stage's count)."""
        if not self.layer_memory:
            return [self.recompute] * stage_layers[p]
        first = sum(stage_layers[:p])
        return list(self.layer_memory[first:first + stage_layers[p]])


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    objective: str  # train | latency
    global_batch: int
    seq_length: int
    dtype: str = "float32"
    optimizer: str = "adamw"
    mp_grad_reduce: str = "after_backward"  # config key of the same name
    dp_engine: str = "ddp"  # ddp | zero1 | deepspeed (pure dp: the search keeps mp = pp = 1) | fsdp2
    zero_stage: int = 1  # deepspeed: 1 shards the optimizer state over dp, 2 the gradients too
    # fsdp2, config keys of the same names: gathered weights freed after forward (default: without a pipeline) or
    # kept to backward; gradients reduce-scattered every micro-batch or once, unsharded ones accumulating
    reshard_after_forward: str = "default"
    fsdp_grad_sync: str = "every_micro_batch"
    sp_attention: str = "allgather"  # config key of the same name: how an ATT.sp block attends (group.py prices it)

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


def fsdp_reshards(reshard_after_forward: str, pp: int) -> bool:
    """Whether FSDP2 gathers each layer again in backward (its weights freed after forward)."""
    return reshard_after_forward == "always" or (reshard_after_forward == "default" and pp == 1)


def fsdp_syncs_once(fsdp_grad_sync: str, microbatches: int) -> bool:
    """Whether FSDP2 reduce-scatters the gradients once a step (unsharded ones held between)."""
    return fsdp_grad_sync == "last_micro_batch" and microbatches > 1


def fsdp_sharded(work: Workload, dp: int, mp: int) -> tuple[bool, bool]:
    """Whether FSDP shards (every weight over dp: ``dp_engine: fsdp2``; the replicated weights of SP blocks
    over mp, over dp x mp with fsdp2: ``mp_grad_reduce: fsdp``)."""
    return dp > 1 and work.dp_engine == "fsdp2", mp > 1 and work.mp_grad_reduce == "fsdp"

@dataclass
class Splits:
    """Per-rank shares, each ``[candidates, mp]``: query heads (ATT.tp), FFN columns (MLP.tp), tokens (SP)."""

    heads: np.ndarray
    ffn: np.ndarray
    seq: np.ndarray

    @classmethod
    def one(cls, heads, ffn, seq) -> "Splits":
        return cls(*(np.atleast_2d(np.asarray(x, dtype=np.int64)) for x in (heads, ffn, seq)))

    @classmethod
    def balanced(cls, m: ModelConfig, seq_length: int, mp: int) -> "Splits":
        return cls.one(balanced_split(m.num_attention_heads, mp), balanced_split(m.intermediate_size, mp),
                       balanced_split(seq_length, mp))
