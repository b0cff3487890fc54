"""Blocks and their boundaries: what layout each block method consumes and produces, the
transition at each boundary, and the self-attention computation every model shares.

    block.method   input  output
    ATT/MLP.tp     T      P
    ATT/MLP.sp     S      S      (ATT.sp attends over the whole sequence: galaxy.core.sp_attention)
    */.none        R      R
    CON.sp         S      S
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from galaxy.config import Method, Plan
from galaxy.core.attention import attention
from galaxy.core.comm import Communicator
from galaxy.core.layers import Dropout
from galaxy.core.recompute import generators_of, recompute
from galaxy.core.sp_attention import sequence_parallel_attention
from galaxy.core.transitions import SEQ_DIM, Layout, SequenceOrder, transition

LAYOUTS = {Method.TP: (Layout.T, Layout.P), Method.SP: (Layout.S, Layout.S), Method.NONE: (Layout.R, Layout.R)}


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype a block computes in: under autocast the stream is fp32 (norms and residual adds
    run in fp32) while the block's matmuls cast their input to the autocast dtype."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


class Boundaries:
    """The transitions of one layer stack: the residual stream lives in CON's layout."""

    def __init__(self, comm: Communicator, plan: Plan, order: Optional[SequenceOrder] = None):
        """``order``: which tokens each rank's stream holds (default contiguous; causal ring attention's zigzag:
        ``sp_attention.stream_order``); the stream runs on the sequence in that order from the embeddings on."""
        self.comm, self.plan = comm, plan
        self.stream = LAYOUTS[plan.con][1]
        self.order = order or SequenceOrder(plan.seq_split)

    def enter(self, h: torch.Tensor, method: Method) -> torch.Tensor:
        """Stream -> the input layout of a block running ``method``, cast to the compute dtype first
        so that the collective moves half the bytes, and so does its backward."""
        return transition(in_compute_dtype(h), self.stream, LAYOUTS[method][0], self.comm, self.plan.seq_split)

    def leave(self, y: torch.Tensor, method: Method) -> torch.Tensor:
        """A block's output -> the stream layout."""
        return transition(y, LAYOUTS[method][1], self.stream, self.comm, self.plan.seq_split)

    def to_stream(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated full-sequence tensor (e.g. input ids) -> this rank's part of the stream."""
        x = self.order.to_stream_order(x)
        return self.comm.split(x, SEQ_DIM, self.plan.seq_split) if self.stream == Layout.S else x

    def stream_offset(self) -> int:
        """Global position of this rank's first stream token."""
        return sum(self.plan.seq_split[: self.comm.rank]) if self.stream == Layout.S else 0

    def to_replicated(self, x: torch.Tensor) -> torch.Tensor:
        """A stream tensor -> the full sequence on every rank (e.g. for a report or a test)."""
        return self.order.to_natural_order(transition(x, self.stream, Layout.R, self.comm, self.plan.seq_split))


def local_offset(method: Method, comm: Communicator, seq_split) -> int:
    return sum(seq_split[: comm.rank]) if method == Method.SP else 0


def self_attention(x: torch.Tensor, q_proj, k_proj, v_proj, *, method: Method, comm: Communicator, plan: Plan,
                   num_heads: int, num_kv_heads: int, head_dim: int, key_padding_mask=None, causal: bool = False,
                   dropout: Optional[Dropout] = None,
                   rope: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]] = None,
                   projected: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                   recompute_core: bool = False) -> torch.Tensor:
    """Attention of an ATT block in its input layout; returns ``[b, s_local, num_heads * head_dim]``.

    ``num_heads``/``num_kv_heads`` are this rank's heads (a TP shard, or all of them).
    ``rope(q, k, positions)`` rotates q and k at ``positions`` before K/V leave the rank: indices into the
    sequence in the stream's order (``Boundaries.order``), which the model's RoPE tables follow.
    ``projected``: q, k, v already computed from the input (CoC fuses the block's entry transition
    with the projections); ``x`` and the ``*_proj`` modules are then not used.
    ``recompute_core``: keep only q, k, v for backward and recompute the attention core there
    (selective recomputation; the score matrix and dropout mask are never stored).
    """
    if projected is None:
        projected = (q_proj(x), k_proj(x), v_proj(x))
    q, k, v = projected
    b, s, _ = q.shape
    q = q.view(b, s, num_heads, head_dim).transpose(1, 2)
    k = k.view(b, s, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, s, num_kv_heads, head_dim).transpose(1, 2)
    offset = local_offset(method, comm, plan.seq_split)
    if rope is not None:
        q, k = rope(q, k, torch.arange(offset, offset + s, device=q.device))
    core = dict(key_padding_mask=key_padding_mask, causal=causal, q_offset=offset, dropout=dropout)
    if method == Method.SP:  # every local query needs every key: the plan's sp_attention flavour
        out = sequence_parallel_attention(q, k, v, comm, plan, recompute_core=recompute_core, **core)
    elif recompute_core:
        out = recompute(attention, q, k, v, generators=generators_of([dropout] if dropout is not None else []),
                        **core)
    else:
        out = attention(q, k, v, **core)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)
