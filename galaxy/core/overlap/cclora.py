"""CCLoRA: LoRA linears with the scale folded into A, the weight merged when that is cheaper, and
the LoRA branch overlapped with the tensor-parallel collective of the base linear.

    y = x W^T + b + s (x A^T) B^T  =  x W^T + b + (x A_s^T) B^T,    A_s = s A

The parameters stay HF PEFT's (A unscaled, so checkpoints do not change): ``A_s`` ([r, in], tiny)
is formed inside the computation, and the gradient of A is ``s`` times that of ``A_s``.

Merged or not, decided per call from this rank's shapes: ``rows`` are the rows of the matmul
(tokens x batch; for an all-gathered input the gathered rows), ``in`` the local weight's width:

    rows >= in   one matmul with W_m = W + B A_s. W_m is formed per call (a rank-r GEMM over W's
                 size) and never kept: backward forms it again for dx instead of holding a copy
                 of every LoRA weight until then.
    rows <  in   base + branch: x W^T + (x A_s^T) B^T; the [rows, r] product is saved for dB.

Either way the gradients are LoRA's exactly: dx = dY W_m (= dY W + (dY B) A_s), dA = s (dY B)^T x,
dB = dY^T (x A_s^T), dW = dY^T x only when W trains (frozen W: no dW matmul at all).

LoRA dropout (``lora_dropout`` > 0, training) drops the branch's input only, which no merged weight
can do: such a linear runs base + branch on x' = x * M. The mask M is drawn as plain LoRA draws it
(the layer's ``Dropout`` on a tensor of the input's shape, batch-major, same generator and order),
so fused and unfused training take the same steps; it is kept for dx = dY W + ((dY B) A_s) * M and
dA = s (dY B)^T x'.

At a TP block edge (``galaxy.core.overlap.edges.CcloraEdge``, which ``galaxy.core.parallelize`` picks
for the TP blocks while ``lora_fusion`` is on) the branch runs while the base linear's collective is in flight:

    S -> T + column linears   forward: the all-gather of x is launched first; under it each LoRA
                              weight is merged, or (unmerged) the LOCAL tokens meet A_s and only
                              that [s_local, r] product is all-gathered (a second, small collective).
                              backward: dx (base + branch, partial) is reduce-scattered; dA, dB (and
                              dW) are computed while it is in flight.
    R -> T + column linears   forward: no communication; backward: dx all-reduced, dA/dB under it.
    row linear + P -> S / R   the branch (x_i A_s,i^T) B^T is part of this rank's partial output, so
                              it rides in the base's reduce-scatter / all-reduce: no collective of
                              its own. Backward (P -> S) all-gathers dY once (W_m is formed under
                              it) and that gathered dY serves dx, dA (via dY B) and dB alike.

Edges without a LoRA linear keep CoC's behaviour, chunked when ``coc_parallel_num`` > 1; an edge
with one runs CCLoRA unchunked (CoC's chunked functions never took LoRA-wrapped linears).
The async collectives are CoC's (``galaxy.core.overlap.coc``): launched with ``async_op=True``,
``work.wait()`` right before the result is used, bytes and observers through the Communicator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from galaxy.core.comm import Communicator
from galaxy.core.layers import Dropout, ParallelLinear
from galaxy.core.overlap.common import (apply_as_autocast, batch_major, finish_into, seq_major, start_all_gather,
                                        start_all_reduce, start_reduce_scatter)

logger = logging.getLogger(__name__)

__all__ = ["LinearOperands", "merges", "operands_of", "cclora_linear", "all_gather_cclora",
           "copy_cclora", "cclora_reduce_scatter", "cclora_all_reduce"]


@dataclass(frozen=True)
class LinearOperands:
    """One linear as the fused functions take it, this rank's pieces: ``weight`` ``[out, in]`` and
    ``bias`` as ``F.linear`` wants them (None where this rank adds none, e.g. a row-parallel bias
    off rank 0) and, for LoRA, ``lora_a`` ``[r, in]`` (unscaled, HF PEFT's A), ``lora_b``
    ``[out, r]``, the scale and the dropout on the branch's input while it is active."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    lora_a: Optional[torch.Tensor] = None
    lora_b: Optional[torch.Tensor] = None
    scale: float = 1.0
    lora_dropout: Optional[Dropout] = None

    @property
    def has_lora(self) -> bool:
        return self.lora_a is not None


def merges(rows: int, in_features: int) -> bool:
    """Whether the merged weight is used: forming W + B A_s costs about out x in x r, the branch
    rows x (in + out) x r, so merging pays once the rows reach the input width."""
    return rows >= in_features


def operands_of(module: torch.nn.Module) -> Optional[LinearOperands]:
    """A linear module's operands for a fused edge, or None when it cannot be fused: a module with
    hooks (they would not run), or anything that offers no ``cclora_operands()``."""
    if not isinstance(module, torch.nn.Module) or module._forward_hooks or module._forward_pre_hooks:
        return None
    if type(module) is ParallelLinear:
        return LinearOperands(module.weight, module.bias if (module.style != "row" or module.rank == 0) else None)
    offer = getattr(module, "cclora_operands", None)
    return offer() if callable(offer) else None


# ----------------------------------------------------------------------------- collectives in flight


class _Gather:
    """An all-gather of sequence-major rows (rank r gives ``sizes[r]``) in flight."""

    def __init__(self, comm: Communicator, local: torch.Tensor, sizes: Sequence[int], phase: str):
        self.sizes = tuple(sizes)
        self.flight = start_all_gather(comm, local, self.sizes, phase)

    def wait(self) -> torch.Tensor:
        recv = self.flight.wait()  # [world, max(sizes), ...]
        if len(set(self.sizes)) == 1:
            return recv.reshape((-1,) + tuple(recv.shape[2:]))  # a view: no copy for even splits
        return torch.cat([recv[r, :n] for r, n in enumerate(self.sizes)])


class _Scatter:
    """A reduce-scatter of full sequence-major rows into this rank's ``sizes[rank]`` in flight."""

    def __init__(self, comm: Communicator, full: torch.Tensor, sizes: Sequence[int], phase: str):
        width, rest = max(sizes), tuple(full.shape[1:])
        if any(n != width for n in sizes):  # uneven pieces: rank r's rows padded into slot r
            send = full.new_zeros((comm.size * width,) + rest)
            start = 0
            for r, n in enumerate(sizes):
                send[r * width: r * width + n].copy_(full[start: start + n])
                start += n
        else:
            send = full.contiguous()
        self.dest = full.new_empty((sizes[comm.rank],) + rest)
        self.flight = start_reduce_scatter(comm, send, tuple(sizes), self.dest, phase)

    def wait(self) -> torch.Tensor:
        finish_into(self.dest, self.flight)
        return self.dest


class _AllReduce:
    """An in-place all-reduce in flight."""

    def __init__(self, comm: Communicator, t: torch.Tensor, phase: str):
        self.flight = start_all_reduce(comm, t, phase)

    def wait(self) -> torch.Tensor:
        return self.flight.wait()


# ----------------------------------------------------------------------------- math on [rows, features]


def _linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())


def _merged(weight: torch.Tensor, lora_b: torch.Tensor, a_s: torch.Tensor) -> torch.Tensor:
    """W + B A_s in one GEMM (rounded once in low precision: the GEMM accumulates in fp32)."""
    return torch.addmm(weight, lora_b, a_s)


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(acc, a, b, out=acc)  # not addmm_: FLOP counters price aten.addmm


def _dropout_mask(dropout: Dropout, batch_major_shape, like: torch.Tensor, sequence_major: bool) -> torch.Tensor:
    """The scaled mask (0 or 1 / (1 - p)) that ``dropout`` applies to an input of this shape: the
    same draw as plain LoRA's ``dropout(x)``, which depends on the shape, dtype and device only.
    Returned in ``like``'s layout (sequence-major when ``sequence_major``)."""
    mask = dropout(torch.ones(batch_major_shape, dtype=like.dtype, device=like.device))
    return seq_major(mask) if sequence_major else mask


def _offsets(ranks: Sequence[int]) -> list[slice]:
    out, start = [], 0
    for r in ranks:
        out.append(slice(start, start + r))
        start += r
    return out


# ----------------------------------------------------------------------------- autograd functions

_LEAD = 6  # non-parameter arguments of _ColumnCCLoRA.forward before *params


class _ColumnCCLoRA(torch.autograd.Function):
    """Linears sharing one input, any of them LoRA: on this rank only (``mode`` "local", any
    style), after R -> T ("copy": dx all-reduced) or after S -> T ("gather": x all-gathered, dx
    reduce-scattered). ``params``: n weights, n biases, n A, n B (None where absent); ``scales[i]``
    is None for a linear without LoRA, ``dropouts[i]`` the active dropout on its branch input."""

    @staticmethod
    def forward(ctx, x, comm: Optional[Communicator], seq_split, mode: str, scales, dropouts, *params):
        n = len(scales)
        weights, biases, lora_a, lora_b = params[:n], params[n:2 * n], params[2 * n:3 * n], params[3 * n:]
        lora = tuple(i for i in range(n) if scales[i] is not None)
        a_s = [lora_a[i] * scales[i] for i in lora]  # the scale folded into A
        gather = mode == "gather"
        if gather:
            xs = seq_major(x)  # [s_local, b, in]: a rank's tokens are one block of rows
            pending = _Gather(comm, xs, seq_split, "fwd")  # the large collective goes first
            rows = sum(seq_split) * xs.shape[1]
        else:
            xs, rows = x, x.numel() // x.shape[-1]
        dropped = any(dropouts[i] is not None for i in lora)
        merged = merges(rows, x.shape[-1]) and not dropped
        eff, xa, xa_pending, masks = list(weights), None, None, {}
        if dropped:  # the masks plain LoRA draws (same stream, same order); under the all-gather of x
            shape = (x.shape[0], sum(seq_split)) if gather else tuple(x.shape[:-1])
            for i in lora:
                if dropouts[i] is not None:
                    masks[i] = _dropout_mask(dropouts[i], shape + (x.shape[-1],), x, gather).reshape(-1, x.shape[-1])
        if lora and merged:
            for i, a in zip(lora, a_s):  # under the all-gather of x: the merge needs no x
                eff[i] = _merged(weights[i], lora_b[i], a)
        elif lora and not dropped:
            a_cat = torch.cat(a_s)  # [R, in]: one GEMM for every LoRA linear of the edge
            xa = torch.mm(xs.reshape(-1, xs.shape[-1]), a_cat.t()).view(tuple(xs.shape[:-1]) + (a_cat.shape[0],))
            if gather:  # the local tokens' rank-r product, computed under the large gather; only it travels
                xa_pending = _Gather(comm, xa, seq_split, "fwd")
        full = pending.wait() if gather else xs
        x2 = full.reshape(-1, full.shape[-1])
        outs = [_linear(x2, w, bias) for w, bias in zip(eff, biases)]
        eff = None  # merged weights are not kept for backward
        if dropped:  # x' = x * M for the branch: all of x is needed, so after the gather
            xa = torch.cat([torch.mm(x2 * masks[i] if i in masks else x2, a.t()) for i, a in zip(lora, a_s)],
                           dim=-1)
        if lora and not merged:
            if xa_pending is not None:
                xa = xa_pending.wait()
            xa2 = xa.view(-1, xa.shape[-1])
            for i, cols in zip(lora, _offsets([a.shape[0] for a in a_s])):
                _add_mm(outs[i], xa2[:, cols], lora_b[i].t())
        ctx.comm, ctx.seq_split, ctx.mode, ctx.scales, ctx.n = comm, seq_split, mode, scales, n
        ctx.lora, ctx.merged, ctx.x_shape, ctx.masked = lora, merged, x.shape, tuple(masks)
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(full, xa, *weights, *lora_a, *lora_b, *masks.values())
        ctx.set_materialize_grads(False)  # an unused output gets no backward work, as in F.linear
        shape = tuple(full.shape[:-1])
        outs = [o.view(shape + (o.shape[-1],)) for o in outs]
        return tuple(batch_major(o) for o in outs) if gather else tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        full, xa, *rest = ctx.saved_tensors
        n, lora, merged, scales = ctx.n, ctx.lora, ctx.merged, ctx.scales
        weights, lora_a, lora_b = rest[:n], rest[n:2 * n], rest[2 * n:3 * n]
        masks = dict(zip(ctx.masked, rest[3 * n:]))
        need = ctx.needs_input_grad
        need_w, need_bias = need[_LEAD:_LEAD + n], need[_LEAD + n:_LEAD + 2 * n]
        need_a, need_b = need[_LEAD + 2 * n:_LEAD + 3 * n], need[_LEAD + 3 * n:]
        gather = ctx.mode == "gather"
        x2 = full.reshape(-1, full.shape[-1])
        d2 = [None if g is None else (seq_major(g) if gather else g).reshape(-1, g.shape[-1]) for g in grads]
        a_s = {i: lora_a[i] * scales[i] for i in lora}
        cols = dict(zip(lora, _offsets([a_s[i].shape[0] for i in lora])))
        live = [i for i in lora if d2[i] is not None]
        dyb = {}

        def dy_b(items):  # dY_i B_i side by side, [rows, sum r_i]: shared by dx (unmerged) and dA
            for i in items:
                if i not in dyb:
                    dyb[i] = torch.mm(d2[i], lora_b[i])
            return dyb[items[0]] if len(items) == 1 else torch.cat([dyb[i] for i in items], dim=-1)

        # 1. The input gradient (partial over the group), then its collective.
        grad_x, pending = None, None
        if need[0]:
            grad_x = x2.new_zeros(x2.shape) if all(d is None for d in d2) else None
            for i, d in enumerate(d2):
                if d is None:
                    continue
                w = _merged(weights[i], lora_b[i], a_s[i]) if (merged and i in a_s) else weights[i]
                if grad_x is None:
                    grad_x = torch.mm(d, w)
                else:
                    _add_mm(grad_x, d, w)
            plain = [i for i in live if i not in masks]
            if plain and not merged:  # every branch's (dY B) A_s in one rank-sum(r) GEMM
                _add_mm(grad_x, dy_b(plain), torch.cat([a_s[i] for i in plain]))
            for i in live:
                if i in masks:  # a dropped-out input: its branch's dx passes the mask
                    grad_x.add_(torch.mm(dy_b([i]), a_s[i]).mul_(masks[i]))
            grad_x = grad_x.view(full.shape)
            if ctx.mode == "gather":
                pending = _Scatter(ctx.comm, grad_x, ctx.seq_split, "bwd")
            elif ctx.mode == "copy":
                pending = _AllReduce(ctx.comm, grad_x, "bwd")
        # 2. The parameter gradients need no communication: they run while dx is in flight.
        grad_w, grad_bias, grad_a, grad_b = [None] * n, [None] * n, [None] * n, [None] * n
        want_a, want_b = [i for i in live if need_a[i]], [i for i in live if need_b[i]]
        shared_a = [i for i in want_a if i not in masks]
        if shared_a:  # dA = s (dY B)^T x, every LoRA linear in one GEMM (x is read once)
            ga = torch.mm(dy_b(shared_a).t(), x2)
            for i, rows in zip(shared_a, _offsets([a_s[i].shape[0] for i in shared_a])):
                grad_a[i] = ga[rows].mul(scales[i])
        for i in want_a:
            if i in masks:  # dA = s (dY B)^T (x * M)
                grad_a[i] = torch.mm(dy_b([i]).t(), x2 * masks[i]).mul_(scales[i])
        if want_b:  # dB = dY^T (x A_s^T): the product saved by the unmerged forward, else formed here
            xa2 = xa.view(-1, xa.shape[-1]) if xa is not None else torch.mm(x2, torch.cat([a_s[i] for i in lora]).t())
            for i in want_b:
                grad_b[i] = torch.mm(d2[i].t(), xa2[:, cols[i]])
        for i, d in enumerate(d2):
            if d is not None and need_w[i]:
                grad_w[i] = torch.mm(d.t(), x2)
            if d is not None and need_bias[i] and ctx.has_bias[i]:
                grad_bias[i] = d.sum(0)
        if grad_x is not None:
            if pending is not None:
                grad_x = pending.wait()
            grad_x = batch_major(grad_x) if gather else grad_x.view(ctx.x_shape)
        return (grad_x, None, None, None, None, None, *grad_w, *grad_bias, *grad_a, *grad_b)


class _RowCCLoRA(torch.autograd.Function):
    """A row-parallel LoRA linear (A sharded like W's columns, B whole; this rank's output is
    partial, branch included) then P -> S ("scatter": reduce-scatter, backward all-gather) or
    P -> R ("reduce": all-reduce, backward identity); ``dropout``: the active one on the branch input."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, comm: Communicator, seq_split, scale: float, mode: str,
                dropout: Optional[Dropout]):
        scatter = mode == "scatter"
        xs = seq_major(x) if scatter else x
        x2 = xs.reshape(-1, xs.shape[-1])
        merged = merges(x2.shape[0], weight.shape[1]) and dropout is None
        a_s = lora_a * scale
        xa = mask = None
        y2 = _linear(x2, _merged(weight, lora_b, a_s) if merged else weight, bias)
        if not merged:
            if dropout is not None:
                mask = _dropout_mask(dropout, x.shape, xs, scatter).reshape(x2.shape)
            xa = torch.mm(x2 if mask is None else x2 * mask, a_s.t())
            _add_mm(y2, xa, lora_b.t())  # the branch joins the partial sum before the collective
        y = y2.view(tuple(xs.shape[:-1]) + (weight.shape[0],))
        if scatter:
            y = batch_major(_Scatter(comm, y, seq_split, "fwd").wait())
        else:
            y = _AllReduce(comm, y, "fwd").wait()
        ctx.comm, ctx.seq_split, ctx.scale, ctx.mode, ctx.merged = comm, seq_split, scale, mode, merged
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, xa, weight, lora_a, lora_b, mask)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, xa, weight, lora_a, lora_b, mask = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        scatter, merged, scale = ctx.mode == "scatter", ctx.merged, ctx.scale
        pending = _Gather(ctx.comm, seq_major(grad), ctx.seq_split, "bwd") if scatter else None
        a_s = lora_a * scale
        w_m = _merged(weight, lora_b, a_s) if (merged and need_x) else None  # under the gather of dY
        dy = pending.wait() if scatter else grad
        xs = seq_major(x) if scatter else x
        x2, d2 = xs.reshape(-1, xs.shape[-1]), dy.reshape(-1, dy.shape[-1])
        # The gathered dY serves everything: dx, dA (through dY B) and dB; nothing is gathered twice.
        dyb = torch.mm(d2, lora_b) if (need_a or (need_x and not merged)) else None
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_x:
            grad_x = torch.mm(d2, w_m if merged else weight)
            if mask is not None:
                grad_x.add_(torch.mm(dyb, a_s).mul_(mask))
            elif not merged:
                _add_mm(grad_x, dyb, a_s)
            grad_x = grad_x.view(xs.shape)
            grad_x = batch_major(grad_x) if scatter else grad_x.view(x.shape)
        if need_a:
            grad_a = torch.mm(dyb.t(), x2 if mask is None else x2 * mask).mul_(scale)
        if need_b:
            grad_b = torch.mm(d2.t(), xa if xa is not None else torch.mm(x2, a_s.t()))
        if need_w:
            grad_w = torch.mm(d2.t(), x2)
        if need_bias and ctx.has_bias:
            grad_bias = d2.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None, None, None, None


# ----------------------------------------------------------------------------- public functions


def _column(x: torch.Tensor, ops: Sequence[LinearOperands], comm, seq_split, mode: str) -> list[torch.Tensor]:
    if not ops:
        raise ValueError("need at least one linear")
    scales = tuple(op.scale if op.has_lora else None for op in ops)
    dropouts = tuple(op.lora_dropout if op.has_lora else None for op in ops)
    params = ([op.weight for op in ops] + [op.bias for op in ops] + [op.lora_a for op in ops]
              + [op.lora_b for op in ops])
    return list(apply_as_autocast(_ColumnCCLoRA, x, comm, tuple(seq_split) if seq_split is not None else None, mode, scales,
                     dropouts, *params))


def cclora_linear(x: torch.Tensor, op: LinearOperands) -> torch.Tensor:
    """One linear of any style on this rank, no communication: ``[..., in]`` -> ``[..., out]``."""
    return _column(x, [op], None, None, "local")[0]


def all_gather_cclora(x_local: torch.Tensor, ops: Sequence[LinearOperands], comm: Communicator,
                      seq_split: Sequence[int]) -> list[torch.Tensor]:
    """S -> T, then column-parallel linears sharing the input: ``[b, seq_split[rank], h]`` ->
    ``[b, sum(seq_split), out_i]`` each; the input gradient comes back reduce-scattered."""
    if len(seq_split) != comm.size or x_local.shape[1] != seq_split[comm.rank]:
        raise ValueError(f"x_local has {x_local.shape[1]} tokens on rank {comm.rank}, but seq_split is "
                         f"{list(seq_split)} for a group of {comm.size}")
    if comm.size == 1:
        return _column(x_local, ops, None, None, "local")
    return _column(x_local, ops, comm, seq_split, "gather")


def copy_cclora(x: torch.Tensor, ops: Sequence[LinearOperands], comm: Communicator) -> list[torch.Tensor]:
    """R -> T, then column-parallel linears: no communication forward, dx all-reduced backward."""
    return _column(x, ops, comm if comm.size > 1 else None, None, "copy" if comm.size > 1 else "local")


def _row(x: torch.Tensor, op: LinearOperands, comm: Communicator, seq_split, mode: str) -> torch.Tensor:
    if not op.has_lora:
        raise ValueError("the row-parallel CCLoRA functions take a LoRA linear (plain ones take CoC's)")
    if comm.size == 1:
        return cclora_linear(x, op)
    return apply_as_autocast(_RowCCLoRA, x, op.weight, op.bias, op.lora_a, op.lora_b, comm, seq_split, op.scale, mode,
                op.lora_dropout)


def cclora_reduce_scatter(x: torch.Tensor, op: LinearOperands, comm: Communicator,
                          seq_split: Sequence[int]) -> torch.Tensor:
    """A row-parallel LoRA linear, then P -> S: ``[b, S, in_local]`` -> ``[b, seq_split[rank], out]``."""
    if len(seq_split) != comm.size or x.shape[1] != sum(seq_split):
        raise ValueError(f"x has {x.shape[1]} tokens but seq_split {list(seq_split)} (group of {comm.size}) "
                         f"sums to {sum(seq_split)}")
    return _row(x, op, comm, tuple(seq_split), "scatter")


def cclora_all_reduce(x: torch.Tensor, op: LinearOperands, comm: Communicator) -> torch.Tensor:
    """A row-parallel LoRA linear, then P -> R (the gradient passes through)."""
    return _row(x, op, comm, None, "reduce")
