"""Activation memory per layer: recompute a region in backward instead of keeping what it saves, and/or hold
what a layer still saves on the host (``galaxy.core.offload``).

``recompute: full`` checkpoints each transformer layer, ``selective`` only the attention core
(softmax(QK^T)V with its dropout, whose score matrix is the largest activation of a layer), ``mlp``
only the MLP between its block edges (its projections and activation: what it keeps of FFN width, the
largest activations of a layer under fused attention, for one more pass of its matmuls; Megatron-LM's
selective ``recompute_modules: [mlp]``); ``recompute_num_layers`` limits any of them to the first K
layers of the model or pipeline stage.

The mechanism is ``torch.utils.checkpoint`` (non-reentrant: it composes with autocast, with the
custom autograd Functions of the transitions and CoC, and with inputs that need no gradient).
Two things it does not do for us:

* Our dropouts draw from explicit ``torch.Generator`` streams owned by the ParallelContext, not
  from the global RNG that ``preserve_rng_state`` saves. So the states of every generator the
  region holds are recorded when its forward starts, set back for the recompute, and afterwards
  returned to wherever they were then: under 1F1B the forwards of later micro-batches have moved
  them on in between, and those must not see a rewound stream.
* Recomputation is not allowed to stop early (torch's default stops once the saved tensors are
  rebuilt): the rest of the region may hold collectives, and every model-parallel rank must issue
  the same ones in the same order, so each rank replays its whole region.

A layer's *memory mode* (``MemoryMode``: config ``layer_memory``, or ``recompute`` /
``recompute_num_layers`` for every layer) is its recompute mode, ``+offload`` for a layer whose saved
tensors (and checkpointed regions' inputs) go to host memory during its forward and come back ahead of its
backward (``galaxy.core.offload``), and the number of sequence chunks its MLP runs in (``mlp_chunks``: with
``mlp`` or ``full`` recompute each chunk is its own recomputed region, so the MLP's backward rebuilds one chunk's
FFN-wide tensors at a time). ``galaxy.core.parallelize`` applies them from outside the model: a layer's
``forward`` runs through ``run_layer_with_memory_mode``, its MLP edge through ``MemoryMode.mlp`` and its attention
core recomputed under ``selective``; ``layer_memory_modes`` gives a stack's modes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from galaxy.config import LAYER_MEMORY_MODES, OFFLOAD, RECOMPUTE_MODES, ConfigError, ModelConfig
from galaxy.core.compile import draws_random
from galaxy.core.offload import (HostCopies, OffloadTraffic, Offloaded, end_layer, not_offloading, offloading,
                                 previous_store)

MODES = RECOMPUTE_MODES
logger = logging.getLogger(__name__)


def layer_modes(mode: str, num_layers: Optional[int], count: int) -> list[str]:
    """The recompute mode of each of a stack's ``count`` layers: ``mode`` for the first
    ``num_layers`` (all when None), ``none`` after them."""
    if mode not in MODES:
        raise ValueError(f"config key 'recompute': '{mode}' is not one of {', '.join(MODES)}")
    first = count if num_layers is None else min(num_layers, count)
    return [mode if i < first else "none" for i in range(count)]


def note_unfused_mlp_edges(modes: Sequence[str], fusable: bool) -> None:
    """``mlp`` runs a TP MLP as one recomputed region, its edges' collectives outside CoC's or async TP's
    overlap (``fusable``: the stack's TP MLP edges would overlap otherwise); the attention's keep it."""
    if fusable and any(MemoryMode.parse(m).recompute == "mlp" for m in modes):
        logger.warning("recompute 'mlp': the TP MLP runs as one recomputed region, so CoC / async TP do not "
                       "overlap its edges (the attention's still do); use recompute selective or full to keep them")


def generators_of(modules: Iterable[nn.Module]) -> list[torch.Generator]:
    """Every distinct ``torch.Generator`` held by these modules or their submodules (the streams of
    their dropouts, LoRA's included), in a stable order."""
    found: dict[int, torch.Generator] = {}
    for root in modules:
        for m in root.modules():
            for value in vars(m).values():
                if isinstance(value, torch.Generator):
                    found.setdefault(id(value), value)
    return list(found.values())


class _Record:
    """Forward context: remembers the generators' states as the region starts."""

    def __init__(self, generators: Sequence[torch.Generator], states: list):
        self.generators, self.states = generators, states

    def __enter__(self):
        self.states[:] = [g.get_state() for g in self.generators]

    def __exit__(self, *exc):
        return False


class _Replay:
    """Recompute context: the recorded states for the replay, the current ones back afterwards."""

    def __init__(self, generators: Sequence[torch.Generator], states: list):
        self.generators, self.states = generators, states
        self.current: list = []

    def __enter__(self):
        self.current = [g.get_state() for g in self.generators]
        for g, state in zip(self.generators, self.states):
            g.set_state(state)

    def __exit__(self, *exc):
        for g, state in zip(self.generators, self.current):
            g.set_state(state)
        return False


def recomputed_when_compiled(fn: Callable, *args):
    """``fn(*args)``; inside a compiled graph its ops are marked for recomputation, so the compiled backward
    rebuilds their output from the inputs instead of keeping it. Meant for a cheap op whose output a weight
    gradient reads while its own backward keeps its inputs anyway (a norm before q/k/v or LoRA A, with the
    cast to the compute dtype; an MLP's activation before its second projection): one tensor less kept,
    for one memory-bound pass in backward. Eagerly the consumer keeps the output whatever happens here, so
    it is a plain call."""
    if not (torch.compiler.is_compiling() and torch.is_grad_enabled()):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def _recompute_every_op(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


# Inside a compiled layer every op of a region is marked for recomputation where autograd traces it, those of a
# custom autograd.Function (the fp8 base's linear) included. A plain checkpoint under torch 2.11 marks only the ops
# outside such a Function (pytorch#177396; 2.13 routes a plain checkpoint through this same selective policy), so
# its partitioner kept an fp8 MLP's projections and ``mlp`` took nothing off the peak.
_EVERY_OP_RECOMPUTED = functools.partial(create_selective_checkpoint_contexts, _recompute_every_op)
# What AOTAutograd's cache keys a graph's checkpointed regions by: the policy is fixed (every op recomputed), so a
# constant names it. Without one, every compiled graph with a recomputed region bypassed that cache (torch 2.13:
# "SAC context_fn does not have a cache_hash attribute") and was traced and partitioned again in each process.
_EVERY_OP_RECOMPUTED.cache_hash = "galaxy.core.recompute: every op PREFER_RECOMPUTE"


def recompute(fn: Callable, *args, generators: Sequence[torch.Generator] = (), **kwargs):
    """``fn(*args, **kwargs)``, keeping only its inputs for backward and running it again there with
    the dropout streams ``generators`` (and the global RNG) as they were in forward. Without
    autograd recording (evaluation, a frozen backbone) it is a plain call. Inside an offloading layer
    (``galaxy.core.offload.offloading``) the tensor inputs are kept on the host, not by the checkpoint."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Inside a compiled layer (galaxy.core.compile) no dropout draws, so no stream needs a
        # replay, and the compiled backward recomputes the region whole.
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_EVERY_OP_RECOMPUTED, **kwargs)
    generators = tuple(generators)
    states: list = []

    def contexts():
        return _Record(generators, states), _Replay(generators, states)

    copies = offloading()
    if copies is not None:
        fn, args = _inputs_on_host(fn, args, copies)
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _inputs_on_host(fn: Callable, args: tuple, copies: HostCopies) -> tuple[Callable, tuple]:
    """``fn`` and ``args`` for a checkpoint that holds no tensor input: the tensors go to the host store now,
    the forward call gets the originals (the graph starts from them) and lets them go, the recompute gets
    them back from the store."""
    held = [(copies.pack(a), a.requires_grad) if isinstance(a, torch.Tensor) else (a, None) for a in args]
    originals = [args]

    def region(**kwargs):
        with not_offloading():
            if originals:
                return fn(*originals.pop(), **kwargs)
            # as the checkpoint's own inputs are in a recompute: detached, needing a gradient where they did
            return fn(*(a if grad is None else copies.unpack(a).detach().requires_grad_(grad) for a, grad in held),
                      **kwargs)

    return region, ()


@dataclass(frozen=True)
class MemoryMode:
    """What one layer does with its activations: ``recompute`` (none | selective | mlp | full), ``offload``
    (what it still saves goes to the host) and ``mlp_chunks`` (sequence chunks of its MLP)."""

    recompute: str = "none"
    offload: bool = False
    mlp_chunks: int = 1

    @classmethod
    def parse(cls, text, mlp_chunks: int = 1) -> "MemoryMode":
        if isinstance(text, MemoryMode):
            return text
        if text not in LAYER_MEMORY_MODES:
            raise ConfigError(f"config key 'layer_memory': '{text}' is not one of {', '.join(LAYER_MEMORY_MODES)}")
        offload = text.endswith(OFFLOAD)
        return cls(text[: -len(OFFLOAD)] if offload else text, offload, mlp_chunks)

    def __str__(self) -> str:
        return self.recompute + (OFFLOAD if self.offload else "")

    def mlp(self, fn: Callable, x: torch.Tensor, modules: Sequence[nn.Module]) -> torch.Tensor:
        """The MLP region ``fn(x)`` (``modules``: those it runs, whose dropout streams a recompute replays)
        over ``mlp_chunks`` sequence chunks (dim -2) where it has that many tokens and draws no dropout mask
        (chunks would draw them in another order; the config says so once), each chunk recomputed under
        ``mlp``, and under ``full`` too where chunked: the layer rebuilt in backward then holds one chunk's
        FFN-wide tensors at a time, not the whole MLP's, for one more pass of the MLP."""
        chunks = 1 if any(draws_random(m) for m in modules) else min(self.mlp_chunks, x.shape[-2])
        if self.recompute != "mlp" and not (self.recompute == "full" and chunks > 1):
            run = fn
        else:
            generators = generators_of(modules)

            def run(part):
                return recompute(fn, part, generators=generators)
        if chunks == 1:
            return run(x)
        return torch.cat([run(part) for part in x.tensor_split(chunks, dim=-2)], dim=-2)


def layer_memory_modes(cfg: ModelConfig, layers: range) -> list[str]:
    """The memory modes of the model's ``layers`` (a stack's, e.g. a pipeline stage's): ``layer_memory``
    (one per model layer) where given, else ``recompute`` on the stack's first ``recompute_num_layers``.
    ``activation_memory: auto`` is resolved into ``layer_memory`` before the model is built
    (``galaxy.planner.activation.resolve_activation_memory``)."""
    if cfg.layer_memory is not None:
        return [cfg.layer_memory[i] for i in layers]
    if cfg.activation_memory == "auto":
        raise ConfigError("config key 'activation_memory' is auto, but no per-layer plan was made for it; the "
                          "CLIs make one before building the model (galaxy.planner.activation."
                          "resolve_activation_memory), or set layer_memory")
    return layer_modes(cfg.recompute, cfg.recompute_num_layers, len(layers))


def run_layer_with_memory_mode(mode: MemoryMode, layer: nn.Module, fn: Callable, h: torch.Tensor, *args,
                               traffic: Optional[OffloadTraffic] = None):
    """``fn(h, *args)``, the forward of ``layer`` under its memory mode: the whole call recomputed in
    backward (``full``; selective and mlp recompute inside ``fn``), and with ``offload`` its saved tensors
    (under full: its input) held on the host (``traffic`` counts the copies). A layer that does not offload
    passes the previous layers' host stores on for prefetching."""
    if not torch.is_grad_enabled():
        return fn(h, *args)
    previous = previous_store(h)
    if not mode.offload:
        out = recompute(fn, h, *args, generators=generators_of([layer])) if mode.recompute == "full" \
            else fn(h, *args)
        return out if previous is None else end_layer(out, HostCopies(layer, h.device, previous))
    copies = HostCopies(layer, h.device, previous, traffic)
    with Offloaded(copies):
        out = recompute(fn, h, *args, generators=generators_of([layer])) if mode.recompute == "full" \
            else fn(h, *args)
    return end_layer(out, copies)
