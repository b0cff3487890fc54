"""The attention of an ATT block, shared by every model and plan, on the projections its entry edge
made (``galaxy.core.edges``):

    block.method   input  output
    ATT/MLP.tp     T      P      (this rank's heads / intermediate columns)
    ATT/MLP.sp     S      S      (ATT.sp attends over the whole sequence: galaxy.core.sp_attention)
    */.none        R      R
    CON.sp         S      S

Under ATT.sp the queries are this rank's tokens and every one needs every key: the plan's
``sp_attention`` flavour (``galaxy.core.sp_attention``: allgather, ring or ulysses) attends over the
whole sequence, running the core it is given where the flavour has one.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from galaxy.core.attention import attention
from galaxy.core.edges import SeqShard
from galaxy.core.layers import Dropout
from galaxy.core.sp_attention import sequence_parallel_attention

Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def split_heads(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[b, s, heads * d]`` -> ``[b, heads, s, d]``."""
    b, s, _ = t.shape
    return t.view(b, s, heads, head_dim).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, d]`` -> ``[b, s, heads * d]``."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b, s, h * d)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, shard: Optional[SeqShard], num_heads: int,
                   num_kv_heads: int, head_dim: int, key_padding_mask=None, causal: bool = False,
                   dropout: Optional[Dropout] = None, rope: Optional[Rope] = None,
                   core: Callable = attention) -> torch.Tensor:
    """Attention of an ATT block on its projections ``[b, s_local, heads * d]`` in its input layout;
    returns ``[b, s_local, num_heads * head_dim]``, the output projection's input.

    ``num_heads``/``num_kv_heads`` are this rank's heads (a TP shard, or all of them). ``shard``: the
    block's sequence shards when it runs SP (``Edge.shard``), else None. ``rope(q, k, positions)`` rotates
    q and k at ``positions`` before K/V leave the rank: indices into the sequence in the stream's order
    (``Stream.order``), which the model's RoPE tables follow. ``core``: the attention core, ``attention``
    or a recomputed one (``recompute: selective``, ``galaxy.core.parallelize``).
    """
    q, k, v = split_heads(q, num_heads, head_dim), split_heads(k, num_kv_heads, head_dim), \
        split_heads(v, num_kv_heads, head_dim)
    offset = shard.offset if shard is not None else 0
    if rope is not None:
        q, k = rope(q, k, torch.arange(offset, offset + q.shape[2], device=q.device))
    kwargs = dict(key_padding_mask=key_padding_mask, causal=causal, q_offset=offset, dropout=dropout)
    if shard is not None:  # every local query needs every key: the plan's sp_attention flavour
        out = sequence_parallel_attention(q, k, v, shard.comm, shard.plan, core=core, **kwargs)
    else:
        out = core(q, k, v, **kwargs)
    return merge_heads(out)
