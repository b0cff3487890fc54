"""CoC: chunked communication/computation overlap for the TP linears at block boundaries.

A TP block meets the residual stream through a transition and a linear. CoC fuses the pair and
cuts the tokens into ``chunks`` pieces, so the collective of one piece runs while the matmul of
another computes (docs/design.md section 3; the Galaxy paper's tile-based overlap):

    all_gather_linear      S -> T, then column-parallel linears sharing the input (q/k/v, gate/up)
    copy_linear            R -> T, then column-parallel linears (the input gradient is all-reduced)
    linear_reduce_scatter  row-parallel linear, then P -> S
    linear_all_reduce      row-parallel linear, then P -> R or P -> T

Each is an autograd function with a hand-written backward that overlaps the adjoint collective
the same way, and the weight-gradient matmuls with whatever collective is still in flight.
``chunks=1`` (or a group of one) is exactly today's path: the core's ``transition`` and
``F.linear``. Results equal that path for any chunk count, world size and uneven split.

Why it overlaps on GPU: NCCL runs async collectives (``async_op=True``) on its own stream, which
waits only for the compute work queued *before* the launch. So every collective is launched as
soon as its input is queued, the matmuls that do not need it are queued after it, and
``work.wait()`` (which makes the compute stream, not the CPU, wait) comes right before its result
is consumed. Inputs that are ready up front (the local shard to all-gather, the output gradient)
launch every chunk at once: the comm stream then runs them back to back.

The schedule, per function (rank r's own tokens never need to travel, which hides the end that
chunking alone would leave exposed):

    all-gather then matmul    launch all chunks; own rows' matmuls first; then chunk c's rows as
                              chunk c lands (forward of all_gather_linear, backward of
                              linear_reduce_scatter)
    matmul then reduce-scatter  chunk c's rows of the other ranks, launch; repeat; own rows last,
                              added locally (forward of linear_reduce_scatter); or all rows per
                              chunk, then the weight gradients under the tail (backward of
                              all_gather_linear)
    matmul then all-reduce    chunk c's rows, launch; repeat (forward of linear_all_reduce,
                              backward of copy_linear, then the weight gradients under the tail)

Layout inside the functions: activations are handled sequence-major, ``[tokens, batch, features]``
and contiguous, so a run of tokens is one block of rows. For batch 1 (the GPU case) that is a
free view of ``[1, s, f]`` and chunks are views: chunks go to the collectives without copies and
reduce-scatters land directly in the output. Batch > 1 pays one transpose copy in and out.

Communication is recorded through the ``Communicator`` (bytes always; a ``CommRecord`` per chunk
for observers, with the same op/phase/byte totals as the unfused path). Timing one collective
needs it finished inside the timed window, so while an observer is attached each chunk's
collective completes before the next is launched: profiling runs measure traffic and per-op
time, the benchmark measures overlap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from galaxy.config import balanced_split
from galaxy.core.comm import Communicator
from galaxy.core.edges import COC_CHOICES, COC_ENV, coc_chunks
from galaxy.core.overlap.common import (apply_as_autocast, batch_major, finish_into, seq_major, start_all_gather,
                                        start_all_reduce, start_reduce_scatter)
from galaxy.core.transitions import Layout, transition

logger = logging.getLogger(__name__)

__all__ = [
    "COC_CHOICES",
    "COC_ENV",
    "ChunkSchedule",
    "all_gather_linear",
    "coc_chunks",
    "copy_linear",
    "linear_all_reduce",
    "linear_reduce_scatter",
]


# ----------------------------------------------------------------------------- the chunk schedule


@dataclass(frozen=True)
class ChunkSchedule:
    """Which tokens of which rank travel in which chunk; identical on every rank.

    Rank r's ``seq_split[r]`` tokens are cut into ``count`` contiguous, near-equal pieces (larger
    first). Each chunk is one collective, so every rank must issue the same ones in the same
    order: ``count = min(chunks, max(seq_split))`` leaves no chunk empty on every rank, while a
    rank with fewer tokens than chunks simply contributes empty pieces to some of them.
    """

    seq_split: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]  # pieces[c][r]: tokens of rank r in chunk c

    @classmethod
    def build(cls, seq_split: Sequence[int], chunks: int) -> "ChunkSchedule":
        seq_split = tuple(int(s) for s in seq_split)
        count = max(1, min(chunks, max(seq_split)))
        per_rank = [balanced_split(n, count) for n in seq_split]
        return cls(seq_split, tuple(tuple(p[c] for p in per_rank) for c in range(count)))

    @property
    def count(self) -> int:
        return len(self.pieces)

    def width(self, c: int) -> int:
        """Rows per rank in chunk c's collective buffer (uneven pieces are padded to this)."""
        return max(self.pieces[c])

    def local(self, c: int, r: int) -> slice:
        """Chunk c's tokens of rank r, as positions in rank r's shard."""
        start = sum(self.pieces[i][r] for i in range(c))
        return slice(start, start + self.pieces[c][r])

    def shard(self, r: int) -> slice:
        """Rank r's whole shard, as positions in the full sequence."""
        start = sum(self.seq_split[:r])
        return slice(start, start + self.seq_split[r])

    def rows(self, c: int, r: int) -> slice:
        """Chunk c's tokens of rank r, as positions in the full sequence."""
        base, piece = self.shard(r).start, self.local(c, r)
        return slice(base + piece.start, base + piece.stop)


def _token_chunks(tokens: int, chunks: int) -> list[slice]:
    """Contiguous near-equal row ranges for collectives over replicated/partial full tensors."""
    if tokens == 0:
        return []
    bounds, start = [], 0
    for n in balanced_split(tokens, min(chunks, tokens)):
        bounds.append(slice(start, start + n))
        start += n
    return bounds


# ----------------------------------------------------------------------------- tensors and matmuls


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[n, b, f]`` block as ``[n * b, f]`` matmul rows (a view)."""
    return t.view(-1, t.shape[-1])


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``out = x W^T + b`` written in place (``F.linear``'s own addmm, no temporary)."""
    if x.numel() == 0:
        return
    if bias is None:
        torch.mm(_flat(x), weight.t(), out=_flat(out))
    else:
        torch.addmm(bias, _flat(x), weight.t(), out=_flat(out))


def _input_grad_into(out: torch.Tensor, grads: Sequence[Optional[torch.Tensor]],
                     weights: Sequence[torch.Tensor]) -> None:
    """``out = sum_i dY_i W_i``: the input gradient of linears sharing one input, in place.
    A None gradient (that output was not used) contributes nothing, as in the unfused graph."""
    if out.numel() == 0:
        return
    pairs = [(g, w) for g, w in zip(grads, weights) if g is not None]
    acc = _flat(out)
    if not pairs:
        acc.zero_()
        return
    torch.mm(_flat(pairs[0][0]), pairs[0][1], out=acc)
    for g, w in pairs[1:]:
        torch.addmm(acc, _flat(g), w, out=acc)  # not addmm_: FLOP counters price aten.addmm


def _rows(t: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dW = dY^T X`` over every token (one matmul)."""
    return torch.mm(_flat(grad).t(), _flat(x))


# ----------------------------------------------------------------------------- async collectives


def _send_buffer(like: torch.Tensor, sched: ChunkSchedule, c: int, world: int, features: int) -> torch.Tensor:
    """Chunk c's reduce-scatter input ``[world * width, b, features]``; padding rows zeroed."""
    width, sizes = sched.width(c), sched.pieces[c]
    buf = like.new_empty((world * width, like.shape[1], features))
    for r, n in enumerate(sizes):
        if n < width:
            buf[r * width + n: (r + 1) * width].zero_()
    return buf


# ----------------------------------------------------------------------------- autograd functions


class _AllGatherLinear(torch.autograd.Function):
    """S -> T fused with column-parallel linears: forward all-gathers x chunk-wise; backward
    reduce-scatters ``sum_i dY_i W_i`` chunk-wise, with dW_i computed while it is in flight."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, sched: ChunkSchedule, n: int, *params):
        weights, biases = params[:n], params[n:]
        xs = seq_major(x)  # [s_local, b, h]
        me, total = comm.rank, sum(sched.seq_split)
        gathered = xs.new_empty((total,) + tuple(xs.shape[1:]))
        outs = [xs.new_empty(total, xs.shape[1], w.shape[0]) for w in weights]
        # Every chunk's input is local already: launch all all-gathers now, back to back.
        flights = [start_all_gather(comm, xs[sched.local(c, me)], sched.pieces[c], "fwd")
                   for c in range(sched.count)]

        def compute(rows: slice) -> None:
            for out, w, b in zip(outs, weights, biases):
                _linear_into(out[rows], gathered[rows], w, b)

        # This rank's own tokens need no communication: computing them first hides chunk 0's gather.
        own = sched.shard(me)
        gathered[own].copy_(xs)
        compute(own)
        for c, flight in enumerate(flights):
            recv = flight.wait()  # chunk c landed; chunks c+1.. are still in flight under the matmuls
            for r, m in enumerate(sched.pieces[c]):
                if r != me and m:
                    rows = sched.rows(c, r)
                    gathered[rows].copy_(recv[r, :m])
                    compute(rows)
        ctx.comm, ctx.sched, ctx.n = comm, sched, n
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(gathered, *weights)
        ctx.set_materialize_grads(False)  # an unused output gets no backward work, as in F.linear
        return tuple(batch_major(o) for o in outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        gathered, *weights = ctx.saved_tensors
        comm, sched, n = ctx.comm, ctx.sched, ctx.n
        need = ctx.needs_input_grad
        dys = [None if g is None else seq_major(g) for g in grads]  # [S, b, out_i]
        grad_x, flights = None, []
        if need[0]:
            me, h = comm.rank, gathered.shape[-1]
            grad_x = gathered.new_empty((sched.seq_split[me],) + tuple(gathered.shape[1:]))
            for c in range(sched.count):
                width, send = sched.width(c), _send_buffer(gathered, sched, c, comm.size, h)
                for r, m in enumerate(sched.pieces[c]):
                    rows = sched.rows(c, r)
                    _input_grad_into(send[r * width: r * width + m], [_rows(d, rows) for d in dys], weights)
                dest = grad_x[sched.local(c, me)]
                # Chunk c's reduce-scatter runs while chunk c+1's input gradient computes.
                flights.append((dest, start_reduce_scatter(comm, send, sched.pieces[c], dest, "bwd")))
        # The weight gradients need no communication: they run while the last chunks are in flight.
        grad_w = [_weight_grad(d, gathered) if d is not None and need[4 + i] else None for i, d in enumerate(dys)]
        grad_b = [_flat(d).sum(0) if d is not None and ctx.has_bias[i] and need[4 + n + i] else None
                  for i, d in enumerate(dys)]
        for dest, flight in flights:
            finish_into(dest, flight)
        return (None if grad_x is None else batch_major(grad_x), None, None, None, *grad_w, *grad_b)


class _CopyLinear(torch.autograd.Function):
    """R -> T fused with column-parallel linears: no communication forward; backward all-reduces
    ``sum_i dY_i W_i`` chunk-wise, with dW_i computed while it is in flight."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, chunks: int, n: int, *params):
        weights, biases = params[:n], params[n:]
        ctx.comm, ctx.chunks, ctx.n = comm, chunks, n
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        comm, n, need = ctx.comm, ctx.n, ctx.needs_input_grad
        # A replicated tensor has no sequence structure to respect: chunk the flattened tokens.
        x2 = _flat(x.contiguous())
        dys = [None if g is None else _flat(g.contiguous()) for g in grads]
        grad_x, flights = None, []
        if need[0]:
            grad_x = torch.empty_like(x2)
            for rows in _token_chunks(x2.shape[0], ctx.chunks):
                _input_grad_into(grad_x[rows], [_rows(d, rows) for d in dys], weights)
                flights.append(start_all_reduce(comm, grad_x[rows], "bwd"))  # overlaps the next chunk
        grad_w = [torch.mm(d.t(), x2) if d is not None and need[4 + i] else None for i, d in enumerate(dys)]
        grad_b = [d.sum(0) if d is not None and ctx.has_bias[i] and need[4 + n + i] else None
                  for i, d in enumerate(dys)]
        for flight in flights:
            flight.wait()
        return (None if grad_x is None else grad_x.view(x.shape), None, None, None, *grad_w, *grad_b)


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel linear fused with P -> S: forward reduce-scatters chunk c while chunk c+1's
    matmul computes (and this rank's own rows, which need no communication, come last); backward
    all-gathers dY chunk-wise under the dX matmuls (own rows first)."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: Communicator, sched: ChunkSchedule):
        xs = seq_major(x)  # [S, b, in_local]
        me = comm.rank  # bias: rank 0's only (added once, as ParallelLinear(style="row") does)
        out = xs.new_empty(sched.seq_split[me], xs.shape[1], weight.shape[0])
        flights = []
        for c in range(sched.count):
            width, send = sched.width(c), _send_buffer(xs, sched, c, comm.size, weight.shape[0])
            for r, m in enumerate(sched.pieces[c]):
                if r == me:  # this rank's own rows stay here: it sends zeros and adds them below
                    send[r * width: r * width + m].zero_()
                else:
                    _linear_into(send[r * width: r * width + m], xs[sched.rows(c, r)], weight, bias)
            dest = out[sched.local(c, me)]
            # Chunk c's reduce-scatter runs while chunk c+1's matmuls compute.
            flights.append((dest, start_reduce_scatter(comm, send, sched.pieces[c], dest, "fwd")))
        # This rank's partial sums for its own tokens need no communication: computing them last
        # hides the final chunk's reduce-scatter.
        own = torch.empty_like(out)
        _linear_into(own, xs[sched.shard(me)], weight, bias)
        for dest, flight in flights:
            finish_into(dest, flight)
        out.add_(own)
        ctx.comm, ctx.sched, ctx.bias_used = comm, sched, bias is not None
        ctx.save_for_backward(x, weight)
        return batch_major(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        comm, sched, me = ctx.comm, ctx.sched, ctx.comm.rank
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_x or need_w or need_b):
            return None, None, None, None, None
        dys, xs = seq_major(grad), seq_major(x)
        dy_full = dys.new_empty((sum(sched.seq_split),) + tuple(dys.shape[1:]))
        flights = [start_all_gather(comm, dys[sched.local(c, me)], sched.pieces[c], "bwd")
                   for c in range(sched.count)]
        grad_x = torch.empty_like(xs) if need_x else None

        def compute(rows: slice) -> None:
            if grad_x is not None and rows.stop > rows.start:
                torch.mm(_flat(dy_full[rows]), weight, out=_flat(grad_x[rows]))

        own = sched.shard(me)  # local rows first: they hide chunk 0's all-gather
        dy_full[own].copy_(dys)
        compute(own)
        for c, flight in enumerate(flights):
            recv = flight.wait()
            for r, m in enumerate(sched.pieces[c]):
                if r != me and m:
                    rows = sched.rows(c, r)
                    dy_full[rows].copy_(recv[r, :m])
                    compute(rows)
        # dW stays one matmul after the loop: per-chunk partial sums would re-read and re-write
        # all of dW once per chunk and round bf16 partials, while dX alone covers the gathers.
        grad_w = _weight_grad(dy_full, xs) if need_w else None
        grad_b = _flat(dy_full).sum(0) if need_b and ctx.bias_used else None
        return (None if grad_x is None else batch_major(grad_x)), grad_w, grad_b, None, None


class _LinearAllReduce(torch.autograd.Function):
    """Row-parallel linear fused with P -> R (backward: identity) or P -> T (backward: all-reduce):
    chunk c's all-reduce runs while chunk c+1's matmul computes, in both directions."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: Communicator, chunks: int, dst: str):
        # All-reduce is elementwise, so the flattened (batch-major) tokens chunk without copies.
        x2 = _flat(x.contiguous())  # bias: rank 0's only
        out = x2.new_empty(x2.shape[0], weight.shape[0])
        flights = []
        for rows in _token_chunks(x2.shape[0], chunks):
            _linear_into(out[rows], x2[rows], weight, bias)
            flights.append(start_all_reduce(comm, out[rows], "fwd"))
        for flight in flights:
            flight.wait()
        ctx.comm, ctx.chunks, ctx.dst, ctx.bias_used = comm, chunks, dst, bias is not None
        ctx.save_for_backward(x, weight)
        return out.view(tuple(x.shape[:-1]) + (weight.shape[0],))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x2, g2 = _flat(x.contiguous()), _flat(grad.contiguous())
        grad_x = torch.empty_like(x2) if need_x else None
        if ctx.dst == "T" and (need_x or need_w or need_b):
            g2 = g2.clone()  # summed in place; the incoming gradient is not ours to modify
            flights = [(rows, start_all_reduce(ctx.comm, g2[rows], "bwd"))
                       for rows in _token_chunks(g2.shape[0], ctx.chunks)]
            for rows, flight in flights:
                flight.wait()  # chunk c summed; later chunks still in flight under this matmul
                if grad_x is not None:
                    torch.mm(g2[rows], weight, out=grad_x[rows])
        elif grad_x is not None:  # P -> R: the gradient is already whole, nothing to overlap
            torch.mm(g2, weight, out=grad_x)
        grad_w = torch.mm(g2.t(), x2) if need_w else None
        grad_b = g2.sum(0) if need_b and ctx.bias_used else None
        return (None if grad_x is None else grad_x.view(x.shape)), grad_w, grad_b, None, None, None


# ----------------------------------------------------------------------------- public API


def _check(chunks: int, comm: Communicator, seq_split: Optional[Sequence[int]] = None) -> None:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if seq_split is not None and len(seq_split) != comm.size:
        raise ValueError(f"seq_split {list(seq_split)} has {len(seq_split)} entries for a group of {comm.size}")


def _pair(weights, biases) -> tuple[list, list]:
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    if not weights or len(biases) != len(weights):
        raise ValueError(f"need one bias (or None) per weight; got {len(weights)} weights, {len(biases)} biases")
    return weights, biases


def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Optional[Sequence[Optional[torch.Tensor]]], comm: Communicator,
                      seq_split: Sequence[int], chunks: int) -> list[torch.Tensor]:
    """S -> T, then the column-parallel linears ``F.linear(x_full, W_i, b_i)`` sharing the input.

    ``x_local`` is ``[b, seq_split[rank], h]``; each result is ``[b, sum(seq_split), out_i]`` in
    global sequence order. The input gradient comes back reduce-scattered, as S -> T's does.
    """
    weights, biases = _pair(weights, biases)
    _check(chunks, comm, seq_split)
    if x_local.shape[1] != seq_split[comm.rank]:
        raise ValueError(f"x_local has {x_local.shape[1]} tokens but seq_split gives rank {comm.rank} "
                         f"{seq_split[comm.rank]}")
    if comm.size == 1 or chunks == 1:
        full = transition(x_local, Layout.S, Layout.T, comm, seq_split)
        return [F.linear(full, w, b) for w, b in zip(weights, biases)]
    sched = ChunkSchedule.build(seq_split, chunks)
    return list(apply_as_autocast(_AllGatherLinear, x_local, comm, sched, len(weights), *weights, *biases))


def copy_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Optional[Sequence[Optional[torch.Tensor]]],
                comm: Communicator, chunks: int) -> list[torch.Tensor]:
    """R -> T, then column-parallel linears: no communication forward; the input gradient is
    all-reduced chunk-wise, overlapped with the input- and weight-gradient matmuls."""
    weights, biases = _pair(weights, biases)
    _check(chunks, comm)
    if comm.size == 1 or chunks == 1:
        full = transition(x, Layout.R, Layout.T, comm, ())
        return [F.linear(full, w, b) for w, b in zip(weights, biases)]
    return list(apply_as_autocast(_CopyLinear, x, comm, chunks, len(weights), *weights, *biases))


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias_on_rank0: Optional[torch.Tensor],
                          comm: Communicator, seq_split: Sequence[int], chunks: int) -> torch.Tensor:
    """Row-parallel ``F.linear`` (bias added on rank 0 only; its gradient follows the PARTIAL
    rule), then P -> S: ``[b, S, in_local]`` -> ``[b, seq_split[rank], out]``."""
    _check(chunks, comm, seq_split)
    if x.shape[1] != sum(seq_split):
        raise ValueError(f"x has {x.shape[1]} tokens but seq_split sums to {sum(seq_split)}")
    if comm.size == 1 or chunks == 1:
        y = F.linear(x, weight, bias_on_rank0 if comm.rank == 0 else None)
        return transition(y, Layout.P, Layout.S, comm, seq_split)
    sched = ChunkSchedule.build(seq_split, chunks)
    # Off rank 0 the bias must not enter the graph at all: a None gradient returned for an input
    # still fires its post-accumulate-grad hooks (which data-parallel bucketing counts).
    return apply_as_autocast(_LinearReduceScatter, x, weight, bias_on_rank0 if comm.rank == 0 else None, comm, sched)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias_on_rank0: Optional[torch.Tensor],
                      comm: Communicator, chunks: int, dst: str = "R") -> torch.Tensor:
    """Row-parallel ``F.linear`` (bias on rank 0 only), then P -> ``dst``: "R" (the gradient
    passes through) or "T" (the gradient is all-reduced too)."""
    _check(chunks, comm)
    if dst not in ("R", "T"):
        raise ValueError(f"dst must be 'R' or 'T', got {dst!r}")
    if comm.size == 1 or chunks == 1:
        y = F.linear(x, weight, bias_on_rank0 if comm.rank == 0 else None)
        return transition(y, Layout.P, Layout(dst), comm, ())
    return apply_as_autocast(_LinearAllReduce, x, weight, bias_on_rank0 if comm.rank == 0 else None, comm, chunks, dst)
