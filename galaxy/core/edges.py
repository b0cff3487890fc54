"""Block edges: where a block meets the residual stream.

A transformer layer's ATT and MLP blocks meet the stream twice (docs/design.md section 1): entering,
the stream's layout becomes the block's input layout and the block's first linears read it; leaving,
the block's last linear's output goes back to the stream's layout. One edge object does both for one
block:

    enter(x, linears) -> [m(x') for m in linears], x' = x in the block's input layout
    leave(y, linear)  -> linear(y), brought to the stream's layout
    run(block, x, *args) -> block(x, edge, *args): the block between its two edges

``PlainEdge`` is the transition then the linears (the linear then the transition): what every plan
computes. The overlapped TP edges (``galaxy.core.overlap``: CoC's chunks, async TP's fused ops,
CCLoRA's LoRA branch under the collective) compute the same results with the collectives and the
matmuls interleaved. ``galaxy.core.parallelize.layer_edges`` picks each block's edge once, from the plan
and the PEFT setting (``lora_fusion``); a model's forward calls the edges it is given and shows only its
math.

``Stream`` is the residual stream's layout itself (CON's) and its token order (``SequenceOrder``: contiguous,
or causal ring attention's zigzag, ``galaxy.core.sp_attention.stream_order``): the model's inputs, labels and
RoPE positions brought to it, its offset in the sequence, its tensors gathered back (for a report or a test).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from galaxy.config import Method, Plan
from galaxy.core.comm import Communicator
from galaxy.core.transitions import SEQ_DIM, Layout, SequenceOrder, transition


# The layouts a block running each method consumes and produces.
LAYOUTS = {Method.TP: (Layout.T, Layout.P), Method.SP: (Layout.S, Layout.S), Method.NONE: (Layout.R, Layout.R)}

COC_CHOICES = (1, 2, 4, 8)
COC_ENV = "COC_PARALLEL_NUM"


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype a block computes in: under autocast the stream is fp32 (norms and residual adds
    run in fp32) while the block's matmuls cast their input to the autocast dtype."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def coc_chunks(config_value: Optional[int] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """The CoC chunk count: the config key ``coc_parallel_num`` when set, else the environment
    variable ``COC_PARALLEL_NUM``, else 1 (no overlap). Only 1, 2, 4 and 8 are accepted."""
    if config_value is not None:
        source, raw = "config key 'coc_parallel_num'", config_value
    else:
        raw = (os.environ if environ is None else environ).get(COC_ENV)
        if raw is None or not str(raw).strip():
            return 1
        source = f"environment variable {COC_ENV}"
    value = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and raw.strip().isdigit():
        value = int(raw.strip())
    if value not in COC_CHOICES:
        raise ValueError(f"{source} is {raw!r}; CoC cuts tokens into 1, 2, 4 or 8 chunks "
                         "(1 = no overlap, today's path)")
    return value


@dataclass(frozen=True)
class SeqShard:
    """The sequence shards of an SP block: rank r holds ``plan.seq_split[r]`` consecutive tokens of the
    stream's order; its attention attends over the whole sequence in the plan's ``sp_attention`` flavour."""

    comm: Communicator
    plan: Plan

    @property
    def split(self) -> tuple[int, ...]:
        return tuple(self.plan.seq_split)

    @property
    def offset(self) -> int:
        """Position of this rank's first token in the stream's order."""
        return sum(self.split[: self.comm.rank])


class Stream:
    """The residual stream of one layer stack: it lives in CON's layout, on the sequence in ``order``
    (default contiguous; causal ring attention's zigzag: ``galaxy.core.sp_attention.stream_order``) from the
    embeddings on."""

    def __init__(self, comm: Communicator, plan: Plan, order: Optional[SequenceOrder] = None):
        self.comm, self.plan = comm, plan
        self.layout = LAYOUTS[plan.con][1]
        self.order = order or SequenceOrder(plan.seq_split)

    @property
    def sharded(self) -> bool:
        """Each rank holds its own tokens (CON.sp on more than one rank): per-rank sums are partial."""
        return self.layout == Layout.S and self.comm.size > 1

    def to_stream(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated full-sequence tensor (e.g. input ids) -> this rank's part of the stream."""
        x = self.order.to_stream_order(x)
        return self.comm.split(x, SEQ_DIM, self.plan.seq_split) if self.layout == Layout.S else x

    def offset(self) -> int:
        """Global position of this rank's first stream token."""
        return sum(self.plan.seq_split[: self.comm.rank]) if self.layout == Layout.S else 0

    def to_replicated(self, x: torch.Tensor) -> torch.Tensor:
        """A stream tensor -> the full sequence on every rank (e.g. for a report or a test)."""
        return self.order.to_natural_order(transition(x, self.layout, Layout.R, self.comm, self.plan.seq_split))


class Edge:
    """The two edges of one block running ``method`` (see the module docstring). ``shard``: the
    block's sequence shards when it runs SP (its attention then sees every key: ``sp_attention``), else None."""

    def __init__(self, comm: Communicator, plan: Plan, method: Method):
        self.comm, self.plan, self.method = comm, plan, method
        self.stream = LAYOUTS[plan.con][1]
        self.shard = SeqShard(comm, plan) if method == Method.SP else None

    def enter(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        raise NotImplementedError

    def leave(self, y: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def run(self, block: Callable, x: torch.Tensor, *args):
        """``block(x, self, *args)``: the block between its edges (it calls ``enter`` and ``leave``)."""
        return block(x, self, *args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.method.value}, stream {self.stream.value}, group of {self.comm.size})"


class PlainEdge(Edge):
    """The transition and the linears, one after the other."""

    def arrive(self, x: torch.Tensor) -> torch.Tensor:
        """Stream -> the block's input layout, cast to the compute dtype first so that the collective
        moves half the bytes, and so does its backward."""
        return transition(in_compute_dtype(x), self.stream, LAYOUTS[self.method][0], self.comm, self.plan.seq_split)

    def depart(self, y: torch.Tensor) -> torch.Tensor:
        """The block's output layout -> the stream's."""
        return transition(y, LAYOUTS[self.method][1], self.stream, self.comm, self.plan.seq_split)

    def enter(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        x = self.arrive(x)
        return [m(x) for m in linears]

    def leave(self, y: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        return self.depart(linear(y))


class LocalEdge(Edge):
    """The linears alone, without the transitions: the inside of a region that keeps its edges'
    collectives out of it (``recompute: mlp``, ``galaxy.core.parallelize``), or a block timed alone (the
    planner's probes)."""

    def enter(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        return [m(x) for m in linears]

    def leave(self, y: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        return linear(y)


class LayerEdges(NamedTuple):
    """The edges of one layer's two blocks."""

    att: Edge
    mlp: Edge

    @classmethod
    def plain(cls, comm: Communicator, plan: Plan) -> "LayerEdges":
        return cls(PlainEdge(comm, plan, plan.att), PlainEdge(comm, plan, plan.mlp))
