"""Activation recomputation: keep a region's inputs in forward and run it again in backward.

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
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

MODES = ("none", "full", "selective", "mlp")
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
    if fusable and "mlp" in modes:
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


def recompute(fn: Callable, *args, generators: Sequence[torch.Generator] = (), **kwargs):
    """``fn(*args, **kwargs)``, keeping only its inputs for backward and running it again there with
    the dropout streams ``generators`` (and the global RNG) as they were in forward. Without
    autograd recording (evaluation, a frozen backbone) it is a plain call."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Inside a compiled layer (galaxy.core.compile) no dropout draws, so no stream needs a
        # replay, and the compiled backward recomputes the region whole.
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    generators = tuple(generators)
    states: list = []

    def contexts():
        return _Record(generators, states), _Replay(generators, states)

    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)
