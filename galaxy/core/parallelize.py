"""How a model's transformer layers compute, applied to the built model from outside it (as torchtitan's
``parallelize_llama`` applies TP, activation checkpointing and compile to a model that holds the math only).

A model's layer is a ``TransformerLayer``: its ``compute`` is the math, calling its block edges
(``self.edges``, ``galaxy.core.edges``) and its attention core (``self.attention_core``); ``forward`` runs
``compute`` through ``self.runner``. ``parallelize`` sets the three on every layer of the model's stacks
(``galaxy.core.pipeline.layer_stack``):

* the edges, picked once per layer by ``layer_edges`` (the one factory of them) from the plan's overlap
  (CoC's chunks, async TP) and ``lora_fusion`` (CCLoRA's PEFT setting; ``GalaxyModel.parallelize`` picks
  them again when it changes);
* the layer's memory mode, from one table (``MODES``): ``full`` recomputes the whole layer in backward,
  ``selective`` its attention core, ``mlp`` its MLP between its edges (that block's edges then plain: the
  region keeps their collectives out); ``none`` keeps everything. Which mode each layer takes:
  ``stack_modes``;
* ``compile``: the layer's compute through ``torch.compile`` (``galaxy.core.compile``), under its mode's
  region.

FSDP shards the layers in the training loop (``galaxy.core.fsdp.shard_model``), whose optimizer holds
what it sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.nn as nn

from galaxy.config import ConfigError, Method, ModelConfig, Plan
from galaxy.core.attention import attention
from galaxy.core.comm import Communicator
from galaxy.core.compile import CompiledLayer
from galaxy.core.edges import Edge, LayerEdges, LocalEdge, PlainEdge, coc_chunks
from galaxy.core.pipeline import layer_stacks
from galaxy.core.recompute import generators_of, layer_modes, note_unfused_mlp_edges, recompute


class TransformerLayer(nn.Module):
    """A transformer layer as ``parallelize`` configures it (see the module docstring); until then its
    edges are plain, its attention core plain and ``forward`` calls ``compute``."""

    def __init__(self, comm: Communicator, plan: Plan):
        super().__init__()
        self.edges = LayerEdges.plain(comm, plan)
        self.attention_core: Callable = attention
        self.runner: Optional[Callable] = None
        self.recompute_mode = "none"

    def compute(self, *args):
        raise NotImplementedError

    def forward(self, *args):
        return (self.runner or self.compute)(*args)


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


class Recomputed:
    """A layer's whole compute (``inner``) as one region: only its inputs kept, run again in backward
    with the dropout streams of the layer (LoRA's included, injected after ``parallelize``) replayed."""

    def __init__(self, inner: Callable, layer: nn.Module):
        self.inner, self.layer = inner, layer  # not an nn.Module: the layer is not its child

    def __call__(self, *args):
        return recompute(self.inner, *args, generators=generators_of([self.layer]))


def recomputed_attention(q, k, v, *, dropout=None, **kwargs):
    """The attention core recomputed in backward (the score matrix and the dropout mask never kept)."""
    return recompute(attention, q, k, v, generators=generators_of([dropout] if dropout is not None else []),
                     dropout=dropout, **kwargs)


class RecomputedEdge(PlainEdge):
    """A block's plain edges whose ``run`` recomputes the block between them: the entry transition's
    output is kept, the linears and what lies between them run again in backward, the collectives
    stay out of the region."""

    def __init__(self, comm: Communicator, plan: Plan, method: Method):
        super().__init__(comm, plan, method)
        self.inside = LocalEdge(comm, plan, method)

    def run(self, block: Callable, x, *args):
        owner = block if isinstance(block, nn.Module) else getattr(block, "__self__", None)
        generators = generators_of([owner]) if isinstance(owner, nn.Module) else []
        y = recompute(block, self.arrive(x), self.inside, *args, generators=generators)
        return self.depart(y)


# ----------------------------------------------------------------------------- the modes


@dataclass(frozen=True)
class LayerMode:
    """What a memory mode does to one layer: ``whole(run, layer) -> run`` wraps its compute, ``core``
    replaces its attention core, ``mlp`` recomputes its MLP between its (plain) edges."""

    whole: Optional[Callable[[Callable, nn.Module], Callable]] = None
    core: Callable = attention
    mlp: bool = False


MODES: dict[str, LayerMode] = {
    "none": LayerMode(),
    "full": LayerMode(whole=Recomputed),
    "selective": LayerMode(core=recomputed_attention),
    "mlp": LayerMode(mlp=True),
}


def stack_modes(cfg: ModelConfig, count: int) -> list[str]:
    """The memory mode (a key of ``MODES``) of each of a stack's ``count`` layers (``recompute``,
    ``recompute_num_layers``)."""
    return layer_modes(cfg.recompute, cfg.recompute_num_layers, count)


# ----------------------------------------------------------------------------- parallelize


def configure_layer(layer: TransformerLayer, comm: Communicator, plan: Plan, choice: EdgeChoice, mode: str,
                    cfg: ModelConfig) -> None:
    """Set one layer's edges, memory ``mode`` and compile (``cfg.compile``, ``cfg.compile_mode``)."""
    applied = MODES[mode]
    mlp = RecomputedEdge(comm, plan, plan.mlp) if applied.mlp else block_edge(comm, plan, plan.mlp, choice)
    layer.edges = LayerEdges(block_edge(comm, plan, plan.att, choice), mlp)
    layer.attention_core = applied.core
    inner = CompiledLayer(layer, comm, cfg.compile_mode) if cfg.compile else None
    if applied.whole is not None:
        inner = applied.whole(inner or layer.compute, layer)
    layer.runner = inner
    layer.recompute_mode = mode


def parallelize(model: nn.Module, plan: Plan, comm: Communicator, cfg: ModelConfig, lora_fusion: bool = False) -> None:
    """Configure every layer of ``model``'s layer stacks (see the module docstring); applying it again
    replaces what it set."""
    choice = EdgeChoice.of(plan, lora_fusion)
    overlapped = type(block_edge(comm, plan, plan.mlp, choice)) is not PlainEdge
    for stack in layer_stacks(model):
        modes = stack_modes(cfg, len(stack))
        note_unfused_mlp_edges(modes, overlapped)
        for layer, mode in zip(stack, modes):
            configure_layer(layer, comm, plan, choice, mode, cfg)
