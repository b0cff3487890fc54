"""Layouts of an activation over the model-parallel group, and the transitions between them.

Each transition is a small autograd pair whose backward is the adjoint of its forward
(docs/design.md section 1). Activations are ``[batch, seq, ...]``; sequence shards are along dim 1.

    from \\ to |  T                           R                          S
    P         |  all-reduce / all-reduce     all-reduce / identity      reduce-scatter / all-gather
    R         |  identity / all-reduce       identity / identity        split / all-gather
    S         |  all-gather / reduce-scatter all-gather / split         identity / identity
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch

from galaxy.core.comm import Communicator

SEQ_DIM = 1


class Layout(str, enum.Enum):
    R = "R"  # replicated: every rank holds the full, identical activation
    P = "P"  # partial: every rank holds a full-shape tensor; the value is the sum over ranks
    S = "S"  # sequence-sharded: rank i holds seq_split[i] tokens
    T = "T"  # replicated input to sharded weights: its gradient comes back partial


# docs/design.md section 1: (forward op, backward op) of each transition; None = no communication
# (identity or a local split).
TRANSITION_OPS: dict[tuple[str, str], tuple[Optional[str], Optional[str]]] = {
    ("P", "T"): ("all_reduce", "all_reduce"),
    ("P", "R"): ("all_reduce", None),
    ("P", "S"): ("reduce_scatter", "all_gather"),
    ("R", "T"): (None, "all_reduce"),
    ("R", "R"): (None, None),
    ("R", "S"): (None, "all_gather"),
    ("S", "T"): ("all_gather", "reduce_scatter"),
    ("S", "R"): ("all_gather", None),
    ("S", "S"): (None, None),
}


class _ReduceToTensorParallel(torch.autograd.Function):
    """P -> T: all-reduce forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_reduce(x, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad, "bwd"), None


class _ReduceToReplicated(torch.autograd.Function):
    """P -> R: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """P -> S: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, sizes):
        ctx.comm, ctx.sizes = comm, sizes
        return comm.reduce_scatter(x, SEQ_DIM, sizes, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, SEQ_DIM, ctx.sizes, "bwd"), None, None


class _CopyToTensorParallel(torch.autograd.Function):
    """R -> T: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad, "bwd"), None


class _ScatterToSequence(torch.autograd.Function):
    """R -> S: split forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, sizes):
        ctx.comm, ctx.sizes = comm, sizes
        return comm.split(x, SEQ_DIM, sizes)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, SEQ_DIM, ctx.sizes, "bwd"), None, None


class _GatherSequenceToTensorParallel(torch.autograd.Function):
    """S -> T: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, comm, sizes):
        ctx.comm, ctx.sizes = comm, sizes
        return comm.all_gather(x, SEQ_DIM, sizes, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter(grad, SEQ_DIM, ctx.sizes, "bwd"), None, None


class _GatherSequenceToReplicated(torch.autograd.Function):
    """S -> R: all-gather forward, split backward."""

    @staticmethod
    def forward(ctx, x, comm, sizes):
        ctx.comm, ctx.sizes = comm, sizes
        return comm.all_gather(x, SEQ_DIM, sizes, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.split(grad, SEQ_DIM, ctx.sizes), None, None


def reduce_to_tensor_parallel(x, comm: Communicator):
    return _ReduceToTensorParallel.apply(x, comm)


def reduce_to_replicated(x, comm: Communicator):
    return _ReduceToReplicated.apply(x, comm)


def reduce_scatter_to_sequence(x, comm: Communicator, sizes: Sequence[int]):
    return _ReduceScatterToSequence.apply(x, comm, tuple(sizes))


def copy_to_tensor_parallel(x, comm: Communicator):
    return _CopyToTensorParallel.apply(x, comm)


def scatter_to_sequence(x, comm: Communicator, sizes: Sequence[int]):
    return _ScatterToSequence.apply(x, comm, tuple(sizes))


def gather_sequence_to_tensor_parallel(x, comm: Communicator, sizes: Sequence[int]):
    return _GatherSequenceToTensorParallel.apply(x, comm, tuple(sizes))


def gather_sequence_to_replicated(x, comm: Communicator, sizes: Sequence[int]):
    return _GatherSequenceToReplicated.apply(x, comm, tuple(sizes))


_TABLE = {
    (Layout.P, Layout.T): lambda x, c, s: reduce_to_tensor_parallel(x, c),
    (Layout.P, Layout.R): lambda x, c, s: reduce_to_replicated(x, c),
    (Layout.P, Layout.S): reduce_scatter_to_sequence,
    (Layout.R, Layout.T): lambda x, c, s: copy_to_tensor_parallel(x, c),
    (Layout.R, Layout.R): lambda x, c, s: x,
    (Layout.R, Layout.S): scatter_to_sequence,
    (Layout.S, Layout.T): gather_sequence_to_tensor_parallel,
    (Layout.S, Layout.R): gather_sequence_to_replicated,
    (Layout.S, Layout.S): lambda x, c, s: x,
}


def transition(x: torch.Tensor, src: Layout, dst: Layout, comm: Communicator, seq_split: Sequence[int]):
    """Bring ``x`` from the producer's layout ``src`` to the consumer's layout ``dst``."""
    if comm.size == 1:
        return x
    try:
        move = _TABLE[(src, dst)]
    except KeyError:
        raise ValueError(f"no transition from layout {src.value} to {dst.value}: "
                         "T is an input-only layout and P an output-only one") from None
    return move(x, comm, seq_split)


class SequenceOrder:
    """Which tokens of the sequence each rank's stream shard holds, rank ``r`` holding ``split[r]`` of them.

    Contiguous (the default): rank r holds one piece, right after rank r-1's. Zigzag (the load-balanced order
    of causal ring attention): each share is cut into a front half (the larger when odd) and a back half; the
    front halves lie in rank order from the start of the sequence and the back halves in reverse rank order
    from its end, so with 2N equal chunks rank r holds chunks r and 2N-1-r and every rank has the same
    causal work. Under zigzag the model runs on the sequence in *stream order* (the ranks' tokens one after
    the other: ``to_stream_order``), where every layout's contiguous split is the zigzag one; only attention
    (which needs true positions) and the model's edges (inputs in, outputs out) see the difference."""

    def __init__(self, split, zigzag: bool = False):
        self.split, self.zigzag = tuple(int(n) for n in split), zigzag
        if zigzag:
            fronts, backs = [(n + 1) // 2 for n in self.split], [n // 2 for n in self.split]
            total, ahead_front, ahead_back, pieces = sum(self.split), 0, 0, []
            for front, back in zip(fronts, backs):
                ahead_back += back
                pieces.append(((ahead_front, front), (total - ahead_back, back)))
                ahead_front += front
        else:
            starts = [sum(self.split[:r]) for r in range(len(self.split))]
            pieces = [((start, n),) for start, n in zip(starts, self.split)]
        # (start, length) of every piece of every rank, empty ones left out
        self.pieces = tuple(tuple(p for p in rank if p[1] > 0) for rank in pieces)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """The global positions of rank ``rank``'s tokens, in the order it holds them."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.pieces[rank]]
                         or [torch.zeros(0, dtype=torch.long, device=device)])

    def to_stream_order(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        """A full-sequence tensor reordered so that rank r's tokens are the r-th contiguous piece."""
        if not self.zigzag:
            return x
        return torch.cat([x.narrow(dim, s, n) for rank in self.pieces for s, n in rank], dim)

    def to_natural_order(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        """The inverse of ``to_stream_order``."""
        if not self.zigzag:
            return x
        held, at = [], 0
        for rank in self.pieces:
            for s, n in rank:
                held.append((s, at, n))
                at += n
        return torch.cat([x.narrow(dim, at, n) for _, at, n in sorted(held)], dim)
