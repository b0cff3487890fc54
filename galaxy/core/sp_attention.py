"""Attention of an SP attention block (ATT.sp): each rank holds its sequence shard of q, k and v (every
head) and returns its own queries' outputs over the whole sequence. Three flavours, chosen per plan
(config key ``sp_attention``):

    allgather  K and V gathered along the sequence in one collective (backward: reduce-scatter), then
               the local queries attend to every key: the Llama 3 paper's context parallelism. Each
               rank moves (N-1)/N of K and V and holds the whole K/V.
    ring       K/V blocks passed between neighbours: each of N steps attends to the block that
               arrived while the next one travels, and merges the partial outputs by their
               log-sum-exp (online softmax); backward is the adjoint ring, the blocks and their dK/dV
               accumulators travelling back around it. The same bytes as allgather in N-1 overlapped
               steps, two blocks held at a time. Causal models run in the zigzag order
               (``transitions.SequenceOrder``: rank r holds chunks r and 2N-1-r), so every step does the
               same work; non-causal ones keep the contiguous order, any split.
    ulysses    DeepSpeed-Ulysses: one all-to-all from sequence shards to head shards (q, k and v
               together), whole-sequence attention on this rank's heads, one all-to-all back. Heads
               split by ``plan.heads_split`` (uneven splits too); a GQA group split over ranks sends
               its key/value head to each of them (as DeepSpeed replicates kv heads when there are
               fewer than ranks), and backward sums the copies' gradients.

Key padding masks work in every flavour; attention dropout in allgather and ulysses (the ring attends
block by block without it: ``galaxy.config`` refuses the combination). The ring's blocks attend with
torch's flash-attention op on CUDA (bf16/fp16, no mask) and with an exact reference elsewhere
(``attend_block``: CPU, float32/float64, and a block whose keys a padding mask hides, whose scores it then
holds for the block); both return the block's log-sum-exp, which the merge and the backward need.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch._compile import _disable_dynamo

from galaxy.config import Method, Plan
from galaxy.core.attention import attention
from galaxy.core.comm import Communicator
from galaxy.core.layers import Dropout
from galaxy.core.transitions import Layout, SequenceOrder, transition

__all__ = ["load_balanced", "stream_order", "sequence_parallel_attention", "gather_kv", "ring_attention",
           "ulysses_attention", "attend_block", "attend_block_backward"]

KV_TAG, DKV_TAG = 1, 2  # the backward ring has both kinds of block in flight between the same ranks


def load_balanced(plan: Plan, causal: bool) -> bool:
    """Whether the stream runs in the zigzag order: causal ring attention on an SP attention block."""
    return causal and plan.att == Method.SP and plan.sp_attention == "ring" and plan.size > 1


def stream_order(plan: Plan, causal: bool) -> SequenceOrder:
    """Which tokens each rank's stream shard holds under ``plan`` for a model with (or without) causal attention."""
    return SequenceOrder(plan.seq_split, zigzag=load_balanced(plan, causal))


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, plan: Plan, *,
                                key_padding_mask=None, causal: bool = False, q_offset: int = 0,
                                dropout: Optional[Dropout] = None, core: Callable = attention) -> torch.Tensor:
    """ATT.sp's attention core in the plan's flavour. q ``[b, heads, s_local, d]``, k and v
    ``[b, kv_heads, s_local, d]`` (every head, this rank's tokens, rotated at their true positions);
    ``key_padding_mask`` ``[b, seq]`` over the whole sequence in natural order; ``q_offset`` the position of
    the first local query (contiguous orders). ``core``: the attention core allgather and ulysses run once the
    keys are there (``attention``, or one recomputed in backward: ``recompute: selective``,
    ``galaxy.core.parallelize``); the ring attends block by block with its own. Returns ``[b, heads, s_local, d]``."""
    kwargs = dict(key_padding_mask=key_padding_mask, causal=causal, dropout=dropout)
    if plan.sp_attention == "ring":
        if dropout is not None and dropout.active:
            raise ValueError("sp_attention ring attends block by block without attention dropout; set "
                             "attention_probs_dropout_prob to 0 or use sp_attention allgather or ulysses")
        return ring_attention(q, k, v, comm, stream_order(plan, causal), key_padding_mask=key_padding_mask,
                              causal=causal)
    if plan.sp_attention == "ulysses":
        return ulysses_attention(q, k, v, comm, plan.seq_split, plan.heads_split, core=core, **kwargs)
    k, v = gather_kv(k, v, comm, plan.seq_split)
    return core(q, k, v, q_offset=q_offset, **kwargs)


def gather_kv(k: torch.Tensor, v: torch.Tensor, comm: Communicator, seq_split) -> tuple[torch.Tensor, torch.Tensor]:
    """allgather: this rank's keys and values ``[b, kv_heads, s_local, d]`` -> the whole sequence's, in one
    collective (S -> T: the gradient comes back reduce-scattered), as every local query needs every key."""
    kv = torch.cat([k, v], dim=-1).transpose(1, 2)
    kv = transition(kv, Layout.S, Layout.T, comm, seq_split).transpose(1, 2)
    return kv.split(k.shape[-1], dim=-1)


# ----------------------------------------------------------------------------- one block, with its LSE


def _flash_fits(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether torch's flash-attention op runs this block: CUDA, half precision, no mask, a head size it takes."""
    d = q.shape[-1]
    return q.is_cuda and mask is None and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def _repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _sum_groups(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``repeat_interleave`` over GQA groups: each kv head sums its query heads' shares."""
    b, heads, s, d = g.shape
    return g if heads == kv_heads else g.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def _scores(q, k, causal: bool, mask: Optional[torch.Tensor], scale: float, dtype) -> torch.Tensor:
    """``q k^T * scale`` in ``dtype``, masked to -inf where a query may not see a key."""
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if causal:  # a square block on the diagonal: the same positions on both sides
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the -inf of rows that see no key replaced by 0, so ``exp(s - lse)`` is 0 there, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                 mask: Optional[torch.Tensor] = None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[b, h, sq, d]`` over one block of keys and values ``[b, h_kv, sk, d]``: the
    block's output (at least fp32) and log-sum-exp ``[b, h, sq]`` (-inf for a row that sees no key, whose
    output is 0). ``causal``: a square block on the diagonal; ``mask``: bool ``[b or 1, 1, sq, sk]``, True =
    attend. The flash op on CUDA where it fits, else the exact reference (float64 stays float64)."""
    heads = q.shape[1]
    k, v = _repeat_kv(k, v, heads)
    if _flash_fits(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                                      0.0, causal, False, scale=scale)[:2]
        return out.float(), lse
    dtype = torch.promote_types(q.dtype, torch.float32)
    s = _scores(q, k, causal, mask, scale, dtype)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse).unsqueeze(-1)) @ v.to(dtype), lse


def attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, *, causal: bool = False, mask: Optional[torch.Tensor] = None,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's shares of dq, dk, dv (at least fp32), given the *merged* output ``out`` and log-sum-exp
    ``lse`` over every block and its gradient ``dout``: the probabilities are exp(s - lse) under the merged
    normaliser, so the shares of all blocks add up to the gradients of the whole attention."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kr, vr = _repeat_kv(k, v, heads)
    if _flash_fits(q, mask):
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the rng state: unread without dropout
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), kr.contiguous(), vr.contiguous(),
            out.to(q.dtype).contiguous(), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
            offset, scale=scale)
        return dq.float(), _sum_groups(dk.float(), kv_heads), _sum_groups(dv.float(), kv_heads)
    dtype = torch.promote_types(q.dtype, torch.float32)
    dout, out = dout.to(dtype), out.to(dtype)
    p = torch.exp(_scores(q, kr, causal, mask, scale, dtype) - _finite(lse).to(dtype).unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ vr.to(dtype).transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = (ds @ kr.to(dtype)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(dtype)) * scale
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (output, lse) into the running ones, in place (online softmax)."""
    merged = torch.logaddexp(lse, block_lse)
    finite = _finite(merged)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(merged)


# ----------------------------------------------------------------------------- ring


def _block_pairs(q_pieces, k_pieces, causal: bool) -> list[tuple[int, int, int, int, str]]:
    """Which parts of a query shard attend to which parts of a key block, and how: ``(q_at, q_len, k_at, k_len,
    kind)`` in local offsets, kind ``full``, ``causal`` (the same positions on both sides) or ``mask`` (a causal
    boundary inside the pair); pairs where no query sees a key are left out. Neighbouring full pairs are
    joined, so a contiguous shard makes one pair per step and a zigzag one at most three."""
    pairs, q_at = [], 0
    for qs, qn in q_pieces:
        k_at = 0
        for ks, kn in k_pieces:
            if not causal or ks + kn - 1 <= qs:
                kind = "full"
            elif ks > qs + qn - 1:
                kind = None
            else:
                kind = "causal" if (qs, qn) == (ks, kn) else "mask"
            if kind is not None:
                pairs.append([q_at, qn, k_at, kn, kind])
            k_at += kn
        q_at += qn
    for axis in (2, 0):  # join along the keys of one query part, then along the queries of one key part
        joined: list = []
        for pair in pairs:
            last = joined[-1] if joined else None
            other = 2 - axis
            if (last is not None and pair[4] == last[4] == "full" and last[other:other + 2] == pair[other:other + 2]
                    and last[axis] + last[axis + 1] == pair[axis]):
                last[axis + 1] += pair[axis + 1]
            else:
                joined.append(list(pair))
        pairs = joined
    return [tuple(p) for p in pairs]


def _positions(pieces, at: int, length: int, device) -> torch.Tensor:
    """The global positions of the tokens ``at .. at + length`` of a shard made of ``pieces``."""
    held = torch.cat([torch.arange(s, s + n, device=device) for s, n in pieces])
    return held[at:at + length]


def _pair_mask(pair, q_pieces, k_pieces, key_keep: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """The bool mask of one pair: a causal boundary inside it and the keys' padding; None when every query sees
    every key it may (``full`` and ``causal`` pairs without padding)."""
    q_at, q_len, k_at, k_len, kind = pair
    k_pos = _positions(k_pieces, k_at, k_len, device)
    mask = None
    if kind == "mask":
        mask = (k_pos[None, :] <= _positions(q_pieces, q_at, q_len, device)[:, None])[None, None]
    if key_keep is not None:
        keep = key_keep[:, k_pos]
        if not bool(keep.all()):
            keep = keep[:, None, None, :]
            mask = keep if mask is None else mask & keep
    return mask


class _RingAttention(torch.autograd.Function):
    """This rank's queries attend to every rank's keys and values, the K/V blocks passed around the ring of mp
    ranks (r sends to r+1): each step attends to the block it holds while the next one travels, and the
    partial outputs merge by their log-sum-exp. Backward is the adjoint ring (r sends to r-1): the blocks go
    around again, each with its dK/dV accumulator, which every rank adds its share to and which ends at the
    block's owner. Keeps q, k, v, the output and its log-sum-exp: never a score matrix."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Communicator, order: SequenceOrder, key_keep, causal: bool):
        ctx.comm, ctx.order, ctx.causal, ctx.key_keep = comm, order, causal, key_keep
        ctx.scale = 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, comm, order, key_keep, causal, ctx.scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.comm, ctx.order, ctx.key_keep, ctx.causal,
                                        ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _ring_forward(q, k, v, comm: Communicator, order: SequenceOrder, key_keep, causal: bool, scale: float):
    n, r, d = comm.size, comm.rank, q.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
    kv = torch.cat([k, v], dim=-1)  # one message a step
    for step in range(n):
        src = (r - step) % n  # whose block this rank holds
        pending = None
        if step < n - 1:
            incoming = kv.new_empty(kv.shape[:2] + (order.split[(src - 1) % n], 2 * d))
            pending = comm.start_exchange(kv, incoming, (r + 1) % n, (r - 1) % n, "fwd", KV_TAG)
        for pair in _block_pairs(order.pieces[r], order.pieces[src], causal):
            q_at, q_len, k_at, k_len, kind = pair
            mask = _pair_mask(pair, order.pieces[r], order.pieces[src], key_keep, q.device)
            block = kv[:, :, k_at:k_at + k_len]
            o, s = attend_block(q[:, :, q_at:q_at + q_len], block[..., :d], block[..., d:], causal=kind == "causal",
                                mask=mask, scale=scale)
            _merge(out[:, :, q_at:q_at + q_len], lse[:, :, q_at:q_at + q_len], o.to(acc), s.to(acc))
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, comm: Communicator, order: SequenceOrder, key_keep, causal: bool,
                   scale: float):
    n, r, d = comm.size, comm.rank, q.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = q.new_zeros(q.shape, dtype=acc)
    kv = torch.cat([k, v], dim=-1)
    carried = None  # the dK/dV accumulator of the block held, on its way round
    for step in range(n):
        held = (r + step) % n  # whose block this rank holds: the adjoint order
        pending = None
        if step < n - 1:
            incoming = kv.new_empty(kv.shape[:2] + (order.split[(held + 1) % n], 2 * d))
            pending = comm.start_exchange(kv, incoming, (r - 1) % n, (r + 1) % n, "bwd", KV_TAG)
        dkv = kv.new_zeros(kv.shape, dtype=acc)
        for pair in _block_pairs(order.pieces[r], order.pieces[held], causal):
            q_at, q_len, k_at, k_len, kind = pair
            rows, cols = slice(q_at, q_at + q_len), slice(k_at, k_at + k_len)
            mask = _pair_mask(pair, order.pieces[r], order.pieces[held], key_keep, q.device)
            block = kv[:, :, cols]
            gq, gk, gv = attend_block_backward(dout[:, :, rows], q[:, :, rows], block[..., :d], block[..., d:],
                                               out[:, :, rows], lse[:, :, rows], causal=kind == "causal",
                                               mask=mask, scale=scale)
            dq[:, :, rows] += gq
            dkv[:, :, cols, :d] += gk
            dkv[:, :, cols, d:] += gv
        if carried is not None:
            dkv += carried.wait()
        incoming_grad = dkv.new_empty(kv.shape[:2] + (order.split[(held + 1) % n], 2 * d))
        carried = comm.start_exchange(dkv, incoming_grad, (r - 1) % n, (r + 1) % n, "bwd", DKV_TAG)
        if pending is not None:
            kv = pending.wait()
    dkv = carried.wait()  # this rank's own block, back from its last visit
    return dq, dkv[..., :d], dkv[..., d:]


# c10d's point-to-point ops do not trace: a compiled layer runs the ring eagerly. torch's lazy form of
# torch.compiler.disable: torch._dynamo (~2 s of CPU) is imported at the first call, not in every process that
# imports Galaxy's models (the graph break still names ring_attention).
@_disable_dynamo
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, order: SequenceOrder, *,
                   key_padding_mask: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
    """Ring attention of this rank's shard (``order.pieces[comm.rank]``) over the whole sequence."""
    key_keep = key_padding_mask.bool() if key_padding_mask is not None else None
    if comm.size == 1:
        return attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal)
    return _RingAttention.apply(q, k, v, comm, order, key_keep, causal)


# ----------------------------------------------------------------------------- Ulysses


def _spans(split: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's piece of a split."""
    return [(sum(split[:r]), n) for r, n in enumerate(split)]


def _sequence_to_heads(comm: Communicator, seq_split, spans, xs, phase: str) -> list[torch.Tensor]:
    """Tensor i ``[b, h_i, s_rank, d_i]`` sends heads ``spans[i][j]`` of its tokens to rank j and becomes
    ``[b, spans[i][rank] heads, seq, d_i]``, the tokens in rank order; one all-to-all for all of them."""
    r, n = comm.rank, comm.size
    pieces = [torch.cat([x.narrow(1, *s[j]).reshape(-1) for x, s in zip(xs, spans)]) for j in range(n)]
    sizes = [[x.shape[0] * s[r][1] * seq_split[i] * x.shape[3] for x, s in zip(xs, spans)] for i in range(n)]
    received = comm.all_to_all(pieces, [(sum(row),) for row in sizes], phase)
    outs = []
    for t, (x, s) in enumerate(zip(xs, spans)):
        parts = [received[i].narrow(0, sum(sizes[i][:t]), sizes[i][t]).view(x.shape[0], s[r][1], seq_split[i],
                                                                             x.shape[3]) for i in range(n)]
        outs.append(torch.cat(parts, dim=2))
    return outs


def _heads_to_sequence(comm: Communicator, seq_split, spans, ys, heads, phase: str) -> list[torch.Tensor]:
    """The adjoint of ``_sequence_to_heads``: tensor i ``[b, spans[i][rank] heads, seq, d_i]`` sends rank j's
    tokens back to it and becomes ``[b, heads[i], s_rank, d_i]``, where the heads that several ranks held
    (overlapping spans) sum their copies; one all-to-all for all of them."""
    r, n = comm.rank, comm.size
    tokens = _spans(seq_split)
    pieces = [torch.cat([y.narrow(2, *tokens[j]).reshape(-1) for y in ys]) for j in range(n)]
    sizes = [[y.shape[0] * s[j][1] * seq_split[r] * y.shape[3] for y, s in zip(ys, spans)] for j in range(n)]
    received = comm.all_to_all(pieces, [(sum(row),) for row in sizes], phase)
    outs = []
    for t, (y, s, h) in enumerate(zip(ys, spans, heads)):
        out = y.new_zeros(y.shape[0], h, seq_split[r], y.shape[3])
        for j in range(n):
            out[:, s[j][0]:s[j][0] + s[j][1]] += received[j].narrow(0, sum(sizes[j][:t]), sizes[j][t]).view(
                y.shape[0], s[j][1], seq_split[r], y.shape[3])
        outs.append(out)
    return outs


class _SequenceToHeads(torch.autograd.Function):
    """Sequence shards of every head -> every token of some heads (``_sequence_to_heads``, q and k/v in one
    all-to-all); backward is the all-to-all back, where a kv head sent to several ranks (a GQA group split over
    them) sums its copies' gradients."""

    @staticmethod
    def forward(ctx, comm: Communicator, seq_split, spans, *xs):
        ctx.comm, ctx.seq_split, ctx.spans, ctx.heads = comm, seq_split, spans, [x.shape[1] for x in xs]
        return tuple(_sequence_to_heads(comm, seq_split, spans, xs, "fwd"))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *_heads_to_sequence(ctx.comm, ctx.seq_split, ctx.spans, grads, ctx.heads, "bwd"))


class _HeadsToSequence(torch.autograd.Function):
    """Every token of this rank's heads -> every head of this rank's tokens (the all-to-all back, heads split
    by ``spans``, disjoint); backward is the all-to-all forth."""

    @staticmethod
    def forward(ctx, y, comm: Communicator, seq_split, spans):
        ctx.comm, ctx.seq_split, ctx.spans = comm, seq_split, spans
        heads = sum(h for _, h in spans)
        return _heads_to_sequence(comm, seq_split, (spans,), [y], [heads], "fwd")[0]

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(ctx.comm, ctx.seq_split, (ctx.spans,), [grad], "bwd")[0], None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, seq_split, head_split, *,
                      key_padding_mask=None, causal: bool = False, dropout: Optional[Dropout] = None,
                      core: Callable = attention) -> torch.Tensor:
    """DeepSpeed-Ulysses attention of this rank's tokens (contiguous shards ``seq_split``), rank r attending
    with the ``head_split[r]`` query heads after those of ranks < r and the key/value heads they read."""
    seq_split, head_split = tuple(seq_split), tuple(head_split)
    if comm.size == 1:
        return core(q, k, v, key_padding_mask=key_padding_mask, causal=causal, dropout=dropout)
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[-1]
    group = heads // kv_heads
    q_spans = tuple(_spans(head_split))
    kv_spans = tuple((a // group, (a + h - 1) // group + 1 - a // group) for a, h in q_spans)
    ql, kvl = _SequenceToHeads.apply(comm, seq_split, (q_spans, kv_spans), q, torch.cat([k, v], dim=-1))
    kl, vl = kvl.split(d, dim=-1)
    first, count = q_spans[comm.rank]
    if first % group or count % group:  # a GQA group split over ranks: each query head gets its kv head
        index = torch.tensor([h // group - kv_spans[comm.rank][0] for h in range(first, first + count)],
                             device=q.device)
        kl, vl = kl.index_select(1, index), vl.index_select(1, index)
    out = core(ql, kl, vl, key_padding_mask=key_padding_mask, causal=causal, q_offset=0, dropout=dropout)
    return _HeadsToSequence.apply(out, comm, seq_split, q_spans)
