"""Per-rank memory of a plan in training: parameters, gradients and optimizer state by each weight's
gradient rule and the dp / mp sharding that holds them (``bytes_per_parameter``, ``stage_parameters``),
FSDP's gathered units (``FsdpUnits``) and the activations a layer keeps for backward under each
recompute mode (``training_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from galaxy.config import Method, balanced_split
from galaxy.core.context import rank_of
from galaxy.planner.group import Compute, GroupModel
from galaxy.planner.workload import (Layout, Splits, Workload, edge_params, fsdp_reshards, fsdp_sharded,
                                     fsdp_syncs_once, layer_params)

OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}


def bytes_per_parameter(work: Workload, dp: int, mp: int, microbatches: int,
                        gradients: bool = True) -> tuple[float, float]:
    """What a rank holds per trainable parameter it has, in bytes: (a parameter of any rule, a PARTIAL one
    under ``mp_grad_reduce: sharded``, or a replicated one of an SP block under ``mp_grad_reduce: fsdp``),
    parameters, gradients and optimizer state (activations apart);
    ``gradients=False``: before the step's first backward has made any (``training_memory``).

    Weights, gradients and optimizer state are in the master precision (float32, float64 for float64
    runs); under bfloat16/float16 autocast keeps a compute-dtype copy of every weight from its first use
    in the forward to the end of the backward (its cache; the backward reads it). ``zero1`` (and
    DeepSpeed) keep 1/dp of the optimizer state, DeepSpeed's ZeRO-2 1/dp of the gradients too.
    ``sharded`` PARTIAL weights: the model holds them once (in the compute dtype under autocast, no
    master there), their gradients only while micro-batches accumulate (the last backward buckets and
    drops them), and 1/mp of them as pieces with master, gradient and optimizer state (ZeRO-2 over mp).
    ``fsdp2`` (and ``fsdp`` over mp): master, gradient and optimizer state as a 1/dp block (1/mp, 1/(dp mp))
    (the gradient whole where it is reduce-scattered once a step); the compute-dtype weights are the ones
    FSDP gathers (``FsdpUnits.gathered_bytes``), not autocast's copies."""
    master = 8 if work.dtype == "float64" else 4
    grad = master if gradients else 0
    low = work.dtype in ("bfloat16", "float16")
    state = OPTIMIZER_STATE_BYTES[work.optimizer] * master / 4
    whole_grads = fsdp_syncs_once(work.fsdp_grad_sync, microbatches)

    def block(shards: int) -> float:
        return (master + grad + state) / shards + (grad * (1 - 1 / shards) if whole_grads else 0)
    over_dp, over_mp = fsdp_sharded(work, dp, mp)
    if over_dp:  # (the config refuses mp_grad_reduce sharded with it)
        return block(dp), block(dp * mp) if over_mp else block(dp)
    split_state = dp if dp > 1 and work.dp_engine in ("zero1", "deepspeed") else 1
    split_grad = dp if dp > 1 and work.dp_engine == "deepspeed" and work.zero_stage == 2 else 1
    whole = master + grad / split_grad + state / split_state + (work.elem if low else 0)
    if over_mp:
        return whole, block(mp)
    if mp == 1 or work.mp_grad_reduce != "sharded":
        return whole, whole
    weight = work.elem if low else master
    accumulating = weight if microbatches > 1 and gradients else 0
    return whole, weight + accumulating + (master + grad + state / split_state) / mp

def stage_parameters(work: Workload, methods: tuple[Method, Method, Method], splits: Splits, layout: Layout,
                     mp: int) -> tuple[dict, dict, dict, dict]:
    """Per pipeline stage, ``[C, mp]`` parameters of each mp rank (the same in every dp replica): all it
    holds, those whose gradient Galaxy sums over the mp group after the backward (PARTIAL), those its
    optimizer steps (sharded PARTIAL weights as 1/mp pieces, 1/dp under ZeRO), and the replicated weights
    of SP blocks FSDP shards over mp (``mp_grad_reduce: fsdp``: their gradients reduce-scattered by FSDP,
    so not among the PARTIAL ones; zero otherwise)."""
    m, pp, dp = work.model, layout.pp, layout.dp
    stage_layers = balanced_split(m.num_hidden_layers, pp)
    emb, head = edge_params(m)
    per_layer = layer_params(m, methods[0], methods[2], methods[1], splits.heads, splits.ffn)
    sharded = mp > 1 and work.mp_grad_reduce == "sharded"
    over_mp = fsdp_sharded(work, dp, mp)[1]
    params, partial, stepped, replicated = {}, {}, {}, {}
    for p in range(pp):
        params[p] = per_layer.total * stage_layers[p] + (emb if p == 0 else 0) + (head if p == pp - 1 else 0)
        edge_partial = (emb if p == 0 else 0) + (head if p == pp - 1 else 0)
        replicated[p] = per_layer.replicated * stage_layers[p] * (1 if over_mp else 0)
        partial[p] = per_layer.partial * stage_layers[p] + (edge_partial if methods[1] == Method.SP else 0) \
            - replicated[p]
        own = params[p] - (partial[p] * (1 - 1 / mp) if sharded else 0) - replicated[p] * (1 - 1 / mp)
        stepped[p] = own / dp if dp > 1 and work.dp_engine in ("zero1", "deepspeed", "fsdp2") else own
    return params, partial, stepped, replicated


def training_memory(g: GroupModel, layout: Layout, p: int, params: np.ndarray, partial: np.ndarray,
                    replicated: np.ndarray) -> np.ndarray:
    """``[C, mp]`` bytes each rank of group ``g`` (pipeline stage ``p`` of ``layout``) holds in training:
    parameters and optimizer state (``params``, of which ``partial`` summed over mp after the backward and
    ``replicated`` sharded over mp by FSDP; ``stage_parameters``), plus the activations held at once. Every
    term is sized by one split variable (or none)."""
    work, m = g.work, g.work.model
    mp, pp, M = g.mp, layout.pp, layout.microbatches
    layers = balanced_split(m.num_hidden_layers, pp)[p]
    layer = g.layer()
    edge = g.head() if p == pp - 1 else []
    C = g.splits.seq.shape[0]
    acts_layer = sum(e.act for e in layer if isinstance(e, Compute))
    acts_edge = sum((e.act for e in edge if isinstance(e, Compute)), np.zeros((C, mp)))
    in_flight = 1 if pp == 1 else (M if layout.schedule == "gpipe" else min(M, pp - p))
    if layout.recompute == "full":  # each layer keeps its input; one layer's activations live in its backward
        held = layers * g.rows * g.tokens * m.hidden_size * work.elem + acts_layer
    elif layout.recompute == "selective":  # the attention cores' activations are rebuilt, one at a time
        core = sum((e.act for e in layer if isinstance(e, Compute) and e.name.startswith("att_core")),
                   np.zeros((C, mp)))
        held = layers * (acts_layer - core) + core
    elif layout.recompute == "mlp":  # the MLPs' activations rebuilt one at a time, each keeping its input
        mlp = sum((e.act for e in layer if isinstance(e, Compute) and e.name.startswith("mlp")), np.zeros((C, mp)))
        tokens = g.splits.seq if g.mlp == Method.SP else g.full(work.seq_length)
        held = layers * (acts_layer - mlp + g.rows * tokens * m.hidden_size * work.elem) + mlp
    else:
        held = layers * acts_layer
    own_sharded = partial if mp > 1 and work.mp_grad_reduce == "sharded" else replicated

    def states(gradients: bool) -> np.ndarray:
        per_param, per_sharded = bytes_per_parameter(work, layout.dp, mp, M, gradients)
        return (params - own_sharded) * per_param + own_sharded * per_sharded

    activations = in_flight * (held + acts_edge)
    gathered = sum(u.gathered_bytes(work, layout) for u in FsdpUnits.of(work, layout, p, params, replicated))
    if M > 1 or (layout.dp > 1 and work.dp_engine == "deepspeed"):  # (DeepSpeed's buffers: kept throughout)
        return states(True) + activations + gathered
    # One micro-batch: its backward makes the gradients as it frees the activations (a step starts with
    # none: zero_grad sets them to None), so the forward's end holds no gradient, the optimizer step no
    # activation. A 7B layer's growth of the peak on an H200 was its states less its gradients plus its
    # saved activations (docs/benchmarks.md).
    return np.maximum(states(False) + activations, states(True)) + gathered


@dataclass(frozen=True)
class FsdpUnits:
    """One kind of FSDP unit of pipeline stage ``p``: ``edge`` root weights (embeddings, head; kept in the
    master precision) and ``layers`` layers of ``per_layer`` weights each (``[C, mp]``; gathered in the
    compute dtype), their bytes per parameter, and per mp rank ``i`` the ranks ``groups[i]`` its shards
    lie over. FSDP2 over dp (``dp_engine: fsdp2``) shards each layer and the root over the dp ranks of
    its mp rank; ``mp_grad_reduce: fsdp`` the replicated weights of SP blocks in each layer over the mp
    group (over the stage's dp x mp ranks with fsdp2)."""

    edge: int
    layers: int
    per_layer: np.ndarray
    master: int
    compute: int
    groups: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, work: Workload, layout: Layout, p: int, params: np.ndarray,
           replicated: Optional[np.ndarray] = None, d: int = 0) -> list["FsdpUnits"]:
        """The kinds of units (none without FSDP) of dp replica ``d``'s stage ``p``, whose mp ranks hold
        ``params``, of which ``replicated`` are sharded over mp (``stage_parameters``)."""
        mp = params.shape[1]
        over_dp, over_mp = fsdp_sharded(work, layout.dp, mp)
        if not (over_dp or over_mp):
            return []
        emb, head = edge_params(work.model)
        edge = (emb if p == 0 else 0) + (head if p == layout.pp - 1 else 0)
        layers = balanced_split(work.model.num_hidden_layers, layout.pp)[p]
        master = 8 if work.dtype == "float64" else 4
        compute = work.elem if work.dtype in ("bfloat16", "float16") else master
        replicated = np.zeros_like(params) if replicated is None else replicated
        dp_ranks = [[rank_of(e, p, i, layout.pp, mp) for e in range(layout.dp)] for i in range(mp)]
        kinds = []
        if over_dp:
            kinds.append(cls(edge, layers, (params - edge - replicated) / layers, master, compute,
                             tuple(tuple(r) for r in dp_ranks)))
        if over_mp:
            group = sorted(r for ranks in dp_ranks for r in ranks) if over_dp else \
                [rank_of(d, p, i, layout.pp, mp) for i in range(mp)]
            kinds.append(cls(0, layers, replicated / layers, master, compute, (tuple(group),) * mp))
        return kinds

    def gathered_bytes(self, work: Workload, layout: Layout) -> np.ndarray:
        """Bytes of these units held gathered: the root's in the master precision for the step, the layers'
        in the compute dtype, two at a time where they are resharded after forward (FSDP's default without
        a pipeline: the running layer and the prefetched next), else all of them."""
        held = min(2, self.layers) if fsdp_reshards(work.reshard_after_forward, layout.pp) else self.layers
        return self.edge * self.master + self.per_layer * self.compute * held

    def step_bytes(self, work: Workload, layout: Layout) -> np.ndarray:
        """A step's bytes of these units' collectives as ``galaxy.core.fsdp.Sharding.count_traffic`` records
        them on a rank: every micro-batch the layers' whole weights gathered (twice where resharded) and the
        root's once; each reduction (every micro-batch, or once a step) every weight's gradient."""
        M = layout.microbatches
        gathers = 2 if fsdp_reshards(work.reshard_after_forward, layout.pp) else 1
        reductions = 1 if fsdp_syncs_once(work.fsdp_grad_sync, M) else M
        layers = self.layers * self.per_layer
        return M * (layers * self.compute * gathers + self.edge * self.master) \
            + reductions * (layers + self.edge) * self.master

def partial_gradient_bytes(work: Workload, partial: np.ndarray, dp: int) -> np.ndarray:
    """Bytes a rank sums over its mp group of ``partial`` PARTIAL gradients (the same on every rank of a
    group): in the master weights' precision, under FSDP2 its dp shard only."""
    grad_bytes = 8 if work.dtype == "float64" else 4
    return partial * grad_bytes / (dp if dp > 1 and work.dp_engine == "fsdp2" else 1)
