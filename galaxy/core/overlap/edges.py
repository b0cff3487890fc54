"""The overlapped TP block edges (``galaxy.core.edges.Edge``), which ``galaxy.core.parallelize`` picks for a
plan's TP blocks: ``CocEdge`` (CoC's chunks, ``coc``), ``AsyncTpEdge`` (torch's symmetric-memory fused ops,
``async_tp``) and ``CcloraEdge`` (the LoRA branch under the base linear's collective, ``cclora``). Each
fuses the entry transition with the block's first linears and its last linear with the exit transition
where the fusion is exact, and takes the plain path (``PlainEdge``) elsewhere.

The fused calls launch and wait for their own async collectives, which torch.compile cannot trace: in a
compiled layer (model key ``compile``) they run eagerly between its graphs (``torch.compiler.disable``,
which imports torch._dynamo: this module is imported only where such an edge is picked)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn as nn

from galaxy.config import Method, Plan
from galaxy.core.comm import Communicator
from galaxy.core.edges import PlainEdge
from galaxy.core.layers import ParallelLinear, StackedLinear
from galaxy.core.overlap.async_tp import AsyncTpEdges, FusedOps, edges_for
from galaxy.core.overlap.cclora import (LinearOperands, all_gather_cclora, cclora_all_reduce, cclora_reduce_scatter,
                                        copy_cclora, operands_of)
from galaxy.core.overlap.coc import all_gather_linear, copy_linear, linear_all_reduce, linear_reduce_scatter
from galaxy.core.transitions import Layout

logger = logging.getLogger(__name__)

__all__ = ["AsyncTpEdge", "CcloraEdge", "CocEdge", "async_tp_edge", "plain_operands"]


def plain_operands(linears: Sequence[nn.Module]) -> Optional[tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]]:
    """The weights and biases of ``linears`` as the fused functions take them, or None when one of them
    is not a plain parallel linear: a wrapped or hooked module (LoRA, an FSDP unit) adds work the fused
    matmul would skip, so such an edge keeps the plain path."""
    weights, biases = [], []
    for m in linears:
        if type(m) not in (ParallelLinear, StackedLinear) or m._forward_hooks or m._forward_pre_hooks:
            return None
        weights.append(m.matrix() if type(m) is StackedLinear else m.weight)
        biases.append(m.bias)
    return weights, biases


class CocEdge(PlainEdge):
    """A TP block's edges with CoC: the entry transition and the block's first linears, and its last
    linear and the exit transition, each one overlapped call cut into ``chunks`` pieces (``chunks`` 1:
    the plain path). Linears that are not plain (``plain_operands``) keep the plain path."""

    def __init__(self, comm: Communicator, plan: Plan, method: Method, chunks: int):
        super().__init__(comm, plan, method)
        self.chunks = chunks
        logger.debug("CoC edge: %d chunk(s), plan %s, stream %s, group of %d", chunks, plan.name,
                     self.stream.value, comm.size)

    def enter(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        ops = plain_operands(linears) if self.chunks > 1 else None
        return super().enter(x, linears) if ops is None else self.fused_enter(x, *ops)

    def leave(self, y: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        ops = plain_operands([linear]) if self.chunks > 1 else None
        return super().leave(y, linear) if ops is None else self.fused_leave(y, ops[0][0], ops[1][0])

    @torch.compiler.disable
    def fused_enter(self, x: torch.Tensor, weights: list[torch.Tensor],
                    biases: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        """Stream (S or R) -> T, then the column-parallel linears on it."""
        if self.stream == Layout.S:
            return all_gather_linear(x, weights, biases, self.comm, self.plan.seq_split, self.chunks)
        return copy_linear(x, weights, biases, self.comm, self.chunks)

    @torch.compiler.disable
    def fused_leave(self, y: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The row-parallel linear on ``y``, then P -> stream (S or R)."""
        if self.stream == Layout.S:
            return linear_reduce_scatter(y, weight, bias, self.comm, self.plan.seq_split, self.chunks)
        return linear_all_reduce(y, weight, bias, self.comm, self.chunks, dst="R")


class AsyncTpEdge(PlainEdge):
    """A TP block's edges on the fused ops (``fused``: an ``AsyncTpEdges``); linears that are not plain
    (``plain_operands``: LoRA, hooks) keep the plain path."""

    def __init__(self, comm: Communicator, plan: Plan, method: Method, fused: AsyncTpEdges):
        super().__init__(comm, plan, method)
        self.fused = fused

    def enter(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        ops = plain_operands(linears)
        return super().enter(x, linears) if ops is None else self.fused_enter(x, *ops)

    def leave(self, y: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        ops = plain_operands([linear])
        return super().leave(y, linear) if ops is None else self.fused_leave(y, ops[0][0], ops[1][0])

    @torch.compiler.disable
    def fused_enter(self, x, weights, biases) -> list[torch.Tensor]:
        return self.fused.enter(x, weights, biases)

    @torch.compiler.disable
    def fused_leave(self, y, weight, bias) -> torch.Tensor:
        return self.fused.leave(y, weight, bias)


def async_tp_edge(comm: Communicator, plan: Plan, method: Method, ops: Optional[FusedOps] = None) -> PlainEdge:
    """The edge of a TP block under ``tp_overlap: async_tp`` (``ops``: torch's symm_mem ops by default),
    plain where the group has nothing to overlap (``edges_for``)."""
    fused = AsyncTpEdges(comm, ops) if ops is not None else edges_for(comm)
    return PlainEdge(comm, plan, method) if fused is None else AsyncTpEdge(comm, plan, method, fused)


class CcloraEdge(CocEdge):
    """A TP block's edges when LoRA fusion is on: an edge whose linears include a LoRA linear (a module
    offering ``cclora_operands()``) runs the CCLoRA functions (``galaxy.core.overlap.cclora``), unchunked;
    an edge without one is CoC's (chunked when ``chunks`` > 1, else plain). A hooked module anywhere on the
    edge keeps it unfused."""

    @staticmethod
    def _lora_operands(linears) -> Optional[list[LinearOperands]]:
        ops = [operands_of(m) for m in linears]
        if ops and all(op is not None for op in ops) and any(op.has_lora for op in ops):
            return ops
        return None

    def enter(self, x: torch.Tensor, linears) -> list[torch.Tensor]:
        ops = self._lora_operands(linears)
        return super().enter(x, linears) if ops is None else self.lora_enter(x, ops)

    def leave(self, y: torch.Tensor, linear) -> torch.Tensor:
        ops = self._lora_operands([linear])
        return super().leave(y, linear) if ops is None else self.lora_leave(y, ops[0])

    @torch.compiler.disable
    def lora_enter(self, x: torch.Tensor, ops: list[LinearOperands]) -> list[torch.Tensor]:
        if self.stream == Layout.S:
            return all_gather_cclora(x, ops, self.comm, self.plan.seq_split)
        return copy_cclora(x, ops, self.comm)

    @torch.compiler.disable
    def lora_leave(self, y: torch.Tensor, op: LinearOperands) -> torch.Tensor:
        if self.stream == Layout.S:
            return cclora_reduce_scatter(y, op, self.comm, self.plan.seq_split)
        return cclora_all_reduce(y, op, self.comm)
