"""How a model's transformer layers compute, applied to the built model from outside it (as torchtitan's
``parallelize_llama`` applies TP, activation checkpointing and compile to a model that holds the math only).

A model's layer is a ``TransformerLayer``: its ``compute`` is the math, calling its block edges
(``self.edges``, ``galaxy.core.edges``) and its attention core (``self.attention_core``); ``forward`` runs
``compute`` (or ``self.compiled``) under ``self.memory_mode`` (``galaxy.core.recompute``). ``parallelize``
sets them on every layer of the model's stacks (``galaxy.core.pipeline.layer_stack``):

* the edges, picked once per layer by ``layer_edges`` (the one factory of them) from the plan's overlap
  (CoC's chunks, async TP) and ``lora_fusion`` (CCLoRA's PEFT setting; ``GalaxyModel.parallelize`` picks
  them again when it changes);
* the layer's memory mode (``MemoryMode``: config ``layer_memory``, or ``recompute`` /
  ``recompute_num_layers``; ``layer_memory_modes``): ``full`` recomputes the whole layer in backward,
  ``selective`` its attention core (``recomputed_attention``), ``mlp`` its MLP between its edges (that
  block's edges then plain, ``RecomputedEdge``: the region keeps their collectives out); ``none`` keeps
  everything; ``+offload`` holds what the layer still saves on the host (``galaxy.core.offload``);
  ``mlp_chunks`` runs the MLP over sequence chunks between plain edges, each chunk its own region;
* ``compile``: the layer's compute through ``torch.compile`` (``galaxy.core.compile``), under its mode's
  regions.

FSDP shards the layers in the training loop (``galaxy.core.fsdp.shard_model``), whose optimizer holds
what it sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch.nn as nn

from galaxy.config import ConfigError, Method, ModelConfig, Plan
from galaxy.core.attention import attention
from galaxy.core.comm import Communicator
from galaxy.core.compile import CompiledLayer
from galaxy.core.edges import Edge, LayerEdges, LocalEdge, PlainEdge, coc_chunks
from galaxy.core.pipeline import layer_stacks
from galaxy.core.recompute import (MemoryMode, generators_of, layer_memory_modes, note_unfused_mlp_edges, recompute,
                                   run_layer_with_memory_mode)


class TransformerLayer(nn.Module):
    """A transformer layer as ``parallelize`` configures it (see the module docstring); until then its
    edges are plain, its attention core plain, its memory mode none and ``forward`` calls ``compute``."""

    def __init__(self, comm: Communicator, plan: Plan):
        super().__init__()
        self.edges = LayerEdges.plain(comm, plan)
        self.attention_core: Callable = attention
        self.memory_mode = MemoryMode()
        self.compiled: Optional[CompiledLayer] = None

    @property
    def recompute_mode(self) -> str:
        """none | full | selective | mlp (``memory_mode.recompute``)."""
        return self.memory_mode.recompute

    def compute(self, *args):
        raise NotImplementedError

    def mlp_modules(self) -> Sequence[nn.Module]:
        """The modules the MLP block runs (whose dropout streams its recomputed regions replay)."""
        raise NotImplementedError

    def forward(self, h, *args):
        """``compute`` (compiled where ``compile`` is set) under the layer's memory mode
        (``run_layer_with_memory_mode``: recomputed whole under ``full``, its saved tensors on the host with
        ``+offload``)."""
        return run_layer_with_memory_mode(self.memory_mode, self, self.compiled or self.compute, h, *args)


# ----------------------------------------------------------------------------- the edges


@dataclass(frozen=True)
class EdgeChoice:
    """What picks the edges of a plan's TP blocks: ``chunks`` (CoC, ``coc_parallel_num``), ``async_tp``
    (``tp_overlap: async_tp``), ``lora_fusion`` (CCLoRA, a PEFT setting)."""

    chunks: int = 1
    async_tp: bool = False
    lora_fusion: bool = False

    @classmethod
    def of(cls, plan: Plan, lora_fusion: bool = False) -> "EdgeChoice":
        return cls(coc_chunks(plan.coc_parallel_num), plan.tp_overlap == "async_tp", lora_fusion)

    def overlaps(self, comm: Communicator) -> bool:
        """Whether a TP block's edges on ``comm`` overlap their collectives (else they are plain).
        Async TP runs with a process group of one too (one GPU checks the path); CoC and CCLoRA
        have nothing to overlap there."""
        return self.async_tp or (comm.size > 1 and (self.chunks > 1 or self.lora_fusion))


def block_edge(comm: Communicator, plan: Plan, method: Method, choice: EdgeChoice) -> Edge:
    """The edge of a block running ``method``: overlapped where ``choice`` overlaps a TP block's
    collectives (``galaxy.core.overlap.edges``, imported only then), else plain."""
    if method != Method.TP or not choice.overlaps(comm):
        return PlainEdge(comm, plan, method)
    if choice.async_tp:
        if choice.lora_fusion:
            raise ConfigError("config key 'tp_overlap' async_tp does not combine with lora_fusion (CCLoRA); "
                              "set tp_overlap to coc or lora_fusion to false")
        from galaxy.core.overlap.edges import async_tp_edge

        return async_tp_edge(comm, plan, method)
    from galaxy.core.overlap.edges import CcloraEdge, CocEdge

    return (CcloraEdge if choice.lora_fusion else CocEdge)(comm, plan, method, choice.chunks)


def layer_edges(comm: Communicator, plan: Plan, choice: EdgeChoice) -> LayerEdges:
    """The edges of one layer: ``block_edge`` for ATT and for MLP."""
    return LayerEdges(block_edge(comm, plan, plan.att, choice), block_edge(comm, plan, plan.mlp, choice))


# ----------------------------------------------------------------------------- regions recomputed in backward


def recomputed_attention(q, k, v, *, dropout=None, **kwargs):
    """The attention core recomputed in backward (the score matrix and the dropout mask never kept)."""
    return recompute(attention, q, k, v, generators=generators_of([dropout] if dropout is not None else []),
                     dropout=dropout, **kwargs)


class RecomputedEdge(PlainEdge):
    """A block's plain edges whose ``run`` runs the block between them as its layer's memory mode says
    (``MemoryMode.mlp``): recomputed in backward (``mlp``; ``full`` where chunked) and/or over ``mlp_chunks``
    sequence chunks, each its own region. The entry transition's output is kept, the linears and what lies
    between them run again in backward, the collectives stay out of the region. ``modules()``: the modules
    the block runs (``TransformerLayer.mlp_modules``), whose dropout streams a recompute replays."""

    def __init__(self, comm: Communicator, plan: Plan, method: Method, mode: MemoryMode,
                 modules: Callable[[], Sequence[nn.Module]]):
        super().__init__(comm, plan, method)
        self.inside = LocalEdge(comm, plan, method)
        self.mode, self.modules = mode, modules

    def run(self, block: Callable, x, *args):
        y = self.mode.mlp(lambda part: block(part, self.inside, *args), self.arrive(x), self.modules())
        return self.depart(y)


# ----------------------------------------------------------------------------- parallelize


def configure_layer(layer: TransformerLayer, comm: Communicator, plan: Plan, choice: EdgeChoice, mode: MemoryMode,
                    cfg: ModelConfig) -> None:
    """Set one layer's edges, memory ``mode`` and compile (``cfg.compile``, ``cfg.compile_mode``)."""
    mlp = block_edge(comm, plan, plan.mlp, choice)
    # recompute mlp: one region, its edges plain; mlp_chunks: regions between plain edges (an overlapped
    # edge keeps the MLP whole)
    if mode.recompute == "mlp" or (mode.mlp_chunks > 1 and type(mlp) is PlainEdge):
        mlp = RecomputedEdge(comm, plan, plan.mlp, mode, layer.mlp_modules)
    layer.edges = LayerEdges(block_edge(comm, plan, plan.att, choice), mlp)
    layer.attention_core = recomputed_attention if mode.recompute == "selective" else attention
    layer.memory_mode = mode
    layer.compiled = (CompiledLayer(layer, comm, cfg.compile_mode, cfg.compile_options, cfg.compile_backend)
                      if cfg.compile else None)


def parallelize(model: nn.Module, plan: Plan, comm: Communicator, cfg: ModelConfig, lora_fusion: bool = False) -> None:
    """Configure every layer of ``model``'s layer stacks (see the module docstring); applying it again
    replaces what it set."""
    choice = EdgeChoice.of(plan, lora_fusion)
    overlapped = type(block_edge(comm, plan, plan.mlp, choice)) is not PlainEdge
    for stack in layer_stacks(model):
        first = getattr(stack, "first", 0)
        modes = layer_memory_modes(cfg, range(first, first + len(stack)))
        note_unfused_mlp_edges(modes, overlapped)
        for layer, mode in zip(stack, modes):
            configure_layer(layer, comm, plan, choice, MemoryMode.parse(mode, cfg.mlp_chunks), cfg)
