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
