"""Per-rank memory of a plan in training: parameters, gradients and optimizer state by each weight's
gradient rule and the dp / mp sharding that holds them (``bytes_per_parameter``, ``stage_parameters``),
FSDP's gathered units (``FsdpUnits``) and the activations a layer keeps for backward under each
memory mode (``ModeCost``: recomputed, offloaded to the host; ``training_memory``), and the fastest per-layer
mix of memory modes that fits a budget (``choose_layer_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import numpy as np

from galaxy.config import LAYER_MEMORY_MODES, OFFLOAD, ConfigError, Method, balanced_split
from galaxy.core.context import rank_of
from galaxy.planner.cluster import ClusterProfile
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


Bytes = Union[float, np.ndarray]
COST_TERMS = ("kept", "host", "rebuilt", "again_s", "exposed_fwd_s", "exposed_bwd_s")  # ModeCost's numbers


@dataclass(frozen=True)
class ModeCost:
    """One layer under one memory mode (``[C, mp]`` arrays in the cost model, numbers for one rank): the bytes
    it keeps on the device from its forward to its backward (``kept``) and on the host (``host``), the device
    bytes its own backward needs beyond ``kept`` (``rebuilt``: recomputed, or brought back), and the seconds it
    adds to a step: its pieces run again (``again_s``) and the host copies' time its forward and backward
    compute does not cover (``exposed_fwd_s``, ``exposed_bwd_s``)."""

    mode: str
    kept: Bytes
    host: Bytes
    rebuilt: Bytes
    again_s: Bytes = 0.0
    exposed_fwd_s: Bytes = 0.0
    exposed_bwd_s: Bytes = 0.0

    @property
    def extra_s(self) -> Bytes:
        return self.again_s + self.exposed_fwd_s + self.exposed_bwd_s

    @property
    def offload(self) -> bool:
        return self.mode.endswith(OFFLOAD)


def with_offload(cost: ModeCost, host_bytes_per_s, fwd_s, bwd_s) -> ModeCost:
    """``cost``'s mode with ``+offload``: what it kept goes to the host over a link of ``host_bytes_per_s``,
    copied behind the layer's forward compute (``fwd_s``) and brought back behind the next layer's backward
    (``bwd_s``); its backward has it back beside what it rebuilds."""
    transfer = cost.kept / host_bytes_per_s
    return ModeCost(cost.mode + OFFLOAD, cost.kept * 0, cost.kept, cost.kept + cost.rebuilt, cost.again_s,
                    np.maximum(transfer - fwd_s, 0.0), np.maximum(transfer - bwd_s, 0.0))


def layer_mode_cost(g: GroupModel, mode: str, host_bytes_per_s) -> ModeCost:
    """A layer of group ``g`` under memory ``mode``, from its pieces' saved bytes and times (``[C, mp]``;
    ``host_bytes_per_s``: each rank's link to its host). Recompute keeps a region's input instead of what it
    saves and runs its pieces again: the attention cores (selective), the MLP (mlp, its input kept) or the layer
    (full, its input kept). Collectives in a recomputed region are priced by ``simulate.predict``, not here."""
    work, m = g.work, g.work.model
    recompute = mode[: -len(OFFLOAD)] if mode.endswith(OFFLOAD) else mode
    pieces = [e for e in g.layer() if isinstance(e, Compute)]
    acts = sum(e.act for e in pieces)

    def of(prefix: str, field: str) -> np.ndarray:
        return sum((getattr(e, field) for e in pieces if e.name.startswith(prefix)), np.zeros_like(acts))
    if recompute == "full":  # each layer keeps its input; one layer's activations live in its backward
        cost = ModeCost(recompute, g.rows * g.tokens * m.hidden_size * work.elem, 0.0, acts, of("", "fwd"))
    elif recompute == "selective":  # the attention cores' activations are rebuilt, one at a time
        core = of("att_core", "act")
        cost = ModeCost(recompute, acts - core, 0.0, core, of("att_core", "fwd"))
    elif recompute == "mlp":  # the MLPs' activations rebuilt one at a time, each keeping its input
        mlp = of("mlp", "act")
        tokens = g.splits.seq if g.mlp == Method.SP else g.full(work.seq_length)
        cost = ModeCost(recompute, acts - mlp + g.rows * tokens * m.hidden_size * work.elem, 0.0, mlp,
                        of("mlp", "fwd"))
    else:
        cost = ModeCost(recompute, acts, 0.0, acts * 0)
    if not mode.endswith(OFFLOAD):
        return cost
    return with_offload(cost, host_bytes_per_s, of("", "fwd"), of("", "bwd"))


def stack_bytes(costs: Sequence[ModeCost], counts: Optional[Sequence[int]] = None) -> tuple[Bytes, Bytes]:
    """(device, host) bytes a stack of layers holds for backward at its peak, ``counts[i]`` layers under
    ``costs[i]`` (each once when None): every layer's kept bytes, the largest rebuilt (one layer's backward at a
    time) and, where any offloads, one offloading layer's host bytes more in flight (its copy during forward,
    the previous layer's prefetch during backward)."""
    counts = [1] * len(costs) if counts is None else counts
    used = [(c, n) for c, n in zip(costs, counts) if n]
    device = sum(n * c.kept for c, n in used) + np.maximum.reduce([c.rebuilt * 1.0 for c, _ in used])
    moving = [c.host for c, _ in used if c.offload]
    if moving:
        device = device + np.maximum.reduce(moving)
    return device, sum((n * c.host for c, n in used), 0.0)


def undominated(options: Sequence[ModeCost]) -> list[ModeCost]:
    """The options no other one beats or equals in every term (time, kept, host, rebuilt, in flight)."""
    def terms(c: ModeCost) -> tuple:
        return float(c.extra_s), float(c.kept), float(c.host), float(c.rebuilt), float(c.host) if c.offload else 0.0
    out = []
    for i, c in enumerate(options):
        beaten = any(all(a <= b for a, b in zip(terms(o), terms(c))) and (terms(o) != terms(c) or j < i)
                     for j, o in enumerate(options) if j != i)
        if not beaten:
            out.append(c)
    return out


def _cheapest_counts(options: Sequence[ModeCost], layers: int, budget: float, weight: str) -> list:
    """For every count j of layers (0..``layers``), the least summed time of j layers under ``options`` whose
    summed ``weight`` (kept or host bytes) is within ``budget``, and its counts per option (None where none
    fits): the Pareto front over (weight, time), one layer added at a time."""
    front = {(0,) * len(options): (0.0, 0.0)}
    best = [(0.0, (0,) * len(options))]
    for _ in range(layers):
        grown = {}
        for counts, (w, time) in front.items():
            for i, o in enumerate(options):
                if w + float(getattr(o, weight)) <= budget:
                    grown[counts[:i] + (counts[i] + 1,) + counts[i + 1:]] = (w + float(getattr(o, weight)),
                                                                             time + float(o.extra_s))
        front, least = {}, np.inf  # by weight, each entry faster than every lighter one (unbounded: the fastest)
        for counts, (w, time) in sorted(grown.items(), key=lambda kv: (kv[1][0], kv[1][1])):
            if time < least:
                if not np.isfinite(budget):
                    front.clear()
                front[counts], least = (w, time), time
        best.append(min(((t, c) for c, (_, t) in front.items()), default=None))
    return best


def choose_layer_memory(options: Sequence[ModeCost], layers: int, device_budget: float,
                        host_budget: float = float("inf")) -> list[str]:
    """The fastest memory mode of each of ``layers`` layers (numbers for one rank, ``options`` one per mode:
    a mode keeps bytes on the device or, offloading, on the host, never both): the least summed ``extra_s``
    whose ``stack_bytes`` fit ``device_budget`` and ``host_budget`` (ties: the fewest bytes copied to the
    host, then the least device bytes). Exact: for each bound on the largest ``rebuilt`` and in-flight host
    bytes (one per option's values), the cheapest j layers that keep on the device within what the bounds leave
    and the cheapest ``layers`` - j that offload within the host budget (``_cheapest_counts``), every j; the
    best of those by their true ``stack_bytes``. The modes that recompute most come first (the stack's first
    layers, as ``recompute_num_layers`` does). One-line ConfigError where nothing fits."""
    kept = undominated(options)
    if any(float(c.kept) > 0 and float(c.host) > 0 for c in kept):
        raise ValueError("a memory mode keeps its bytes on the device or on the host, not both")
    candidates, fronts = set(), {}

    def cheapest(group: list[int], budget: float, weight: str) -> list:
        key = (tuple(group), budget, weight)
        if key not in fronts:
            fronts[key] = _cheapest_counts([kept[i] for i in group], layers, budget, weight)
        return fronts[key]

    for most_rebuilt in sorted({float(c.rebuilt) for c in kept}):
        for most_moving in sorted({0.0} | {float(c.host) for c in kept if c.offload}):
            allowed = [i for i, c in enumerate(kept) if float(c.rebuilt) <= most_rebuilt
                       and (not c.offload or float(c.host) <= most_moving)]
            on_device = [i for i in allowed if not kept[i].offload]
            on_host = [i for i in allowed if kept[i].offload]
            device = cheapest(on_device, device_budget - most_rebuilt - most_moving, "kept")
            host = cheapest(on_host, host_budget, "host")
            for j in range(layers + 1):
                if device[j] is not None and host[layers - j] is not None:
                    full = [0] * len(kept)
                    for group, (_, counts) in ((on_device, device[j]), (on_host, host[layers - j])):
                        for i, n in zip(group, counts):
                            full[i] = n
                    candidates.add(tuple(full))
    scored = []
    for counts in candidates:
        device_bytes, host_bytes = stack_bytes(kept, counts)
        if device_bytes <= device_budget and host_bytes <= host_budget:
            scored.append((float(sum(n * float(c.extra_s) for c, n in zip(kept, counts))), float(host_bytes),
                           float(device_bytes), counts))
    if not scored:
        # One mode for every layer needs the least device memory of any plan: a mix holds at least its mode of
        # least kept bytes on every layer, its largest rebuilt and in-flight bytes. Named among those within
        # the host budget where any is.
        within_host = [c for c in kept if float(stack_bytes([c], [layers])[1]) <= host_budget] or kept
        least = min(within_host, key=lambda c: float(stack_bytes([c], [layers])[0]))
        need = float(stack_bytes([least], [layers])[0])
        raise ConfigError(f"config key 'memory_budget_gib': no per-layer memory plan of {layers} layers fits "
                          f"{device_budget / 2**30:.2f} GiB for activations (the least, every layer "
                          f"{least.mode}, needs "
                          f"{need / 2**30:.2f} GiB" + (f", within {host_budget / 2**30:.2f} GiB of host memory"
                                                       if np.isfinite(host_budget) else "")
                          + "); raise memory_budget_gib or shorten seq_length / micro_batch_size")
    counts = min(scored)[3]
    order = sorted(range(len(kept)), key=lambda i: -float(kept[i].extra_s))
    return [kept[i].mode for i in order for _ in range(counts[i])]


def stage_mode_costs(g: GroupModel, layout: Layout, p: int) -> tuple[list[ModeCost], list[int]]:
    """The distinct memory modes of stage ``p``'s layers (``layout.stage_modes``) as ``ModeCost`` and how many
    layers run each."""
    modes = layout.stage_modes(balanced_split(g.work.model.num_hidden_layers, layout.pp), p)
    distinct = list(dict.fromkeys(modes))
    for mode in distinct:  # each mode's cost once per group: the step's time, memory and host memory all ask
        if mode not in g.mode_costs:
            bandwidth = np.array([g.cluster.ranks[r].host_link_bytes_per_s for r in g.ranks], dtype=float)
            g.mode_costs[mode] = layer_mode_cost(g, mode, bandwidth)
    return [g.mode_costs[mode] for mode in distinct], [modes.count(mode) for mode in distinct]


def host_memory(g: GroupModel, layout: Layout, p: int) -> np.ndarray:
    """``[C, mp]`` bytes each rank of group ``g`` holds on its host for offloaded layers (its micro-batches in
    flight each)."""
    in_flight = 1 if layout.pp == 1 else (layout.microbatches if layout.schedule == "gpipe"
                                          else min(layout.microbatches, layout.pp - p))
    return in_flight * np.broadcast_to(stack_bytes(*stage_mode_costs(g, layout, p))[1], g.splits.seq.shape)


def memory_terms(g: GroupModel, layout: Layout, p: int, params: np.ndarray, partial: np.ndarray,
                 replicated: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray], int, np.ndarray, np.ndarray]:
    """(before, after, in_flight, edge, gathered), ``[C, mp]`` arrays but ``in_flight``: a rank of group ``g``
    (pipeline stage ``p``) holds ``before + in_flight * (held + edge) + gathered`` in training, or where
    ``after`` is given the larger of that less ``gathered`` and ``after``, plus ``gathered``; ``held`` is what
    its layers keep for backward (``stack_bytes``), ``edge`` the embeddings' and head's activations.
    ``params``, of which ``partial`` are summed over mp after the backward and ``replicated`` sharded over mp
    by FSDP: ``stage_parameters``."""
    work = g.work
    mp, pp, M = g.mp, layout.pp, layout.microbatches
    edge = g.head() if p == pp - 1 else []
    C = g.splits.seq.shape[0]
    acts_edge = sum((e.act for e in edge if isinstance(e, Compute)), np.zeros((C, mp)))
    in_flight = 1 if pp == 1 else (M if layout.schedule == "gpipe" else min(M, pp - p))
    own_sharded = partial if mp > 1 and work.mp_grad_reduce == "sharded" else replicated

    def states(gradients: bool) -> np.ndarray:
        per_param, per_sharded = bytes_per_parameter(work, layout.dp, mp, M, gradients)
        return (params - own_sharded) * per_param + own_sharded * per_sharded

    gathered = sum(u.gathered_bytes(work, layout) for u in FsdpUnits.of(work, layout, p, params, replicated))
    if M > 1 or (layout.dp > 1 and work.dp_engine == "deepspeed"):  # (DeepSpeed's buffers: kept throughout)
        return states(True), None, in_flight, acts_edge, gathered
    # One micro-batch: its backward makes the gradients as it frees the activations (a step starts with
    # none: zero_grad sets them to None), so the forward's end holds no gradient, the optimizer step no
    # activation. A 7B layer's growth of the peak on an H200 was its states less its gradients plus its
    # saved activations (docs/benchmarks-log.md).
    return states(False), states(True), in_flight, acts_edge, gathered


def training_memory(g: GroupModel, layout: Layout, p: int, params: np.ndarray, partial: np.ndarray,
                    replicated: np.ndarray) -> np.ndarray:
    """``[C, mp]`` bytes each rank of group ``g`` (pipeline stage ``p`` of ``layout``) holds in training:
    parameters and optimizer state (``memory_terms``), plus the activations held at once: each layer's under
    its memory mode (``stage_mode_costs``). Every term is sized by one split variable (or none)."""
    before, after, in_flight, acts_edge, gathered = memory_terms(g, layout, p, params, partial, replicated)
    activations = in_flight * (stack_bytes(*stage_mode_costs(g, layout, p))[0] + acts_edge)
    if after is None:
        return before + activations + gathered
    return np.maximum(before + activations, after) + gathered


def plan_layer_memory(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method],
                      splits: Splits, layout: Layout, modes: Sequence[str] = LAYER_MEMORY_MODES) -> Layout:
    """``layout`` with the fastest per-layer memory modes (of ``modes``) that fit every rank's memory and host
    budgets by this model (``choose_layer_memory`` per stage, over its group's ranks: each mode at its largest
    cost among them, the least budget; exact where the group is one rank). ``splits``: one candidate."""
    dp, pp = layout.dp, layout.pp
    mp = cluster.world // (dp * pp)
    rows = work.global_batch // (dp * layout.microbatches)
    params, partial, _, replicated = stage_parameters(work, methods, splits, layout, mp)
    stage_layers = balanced_split(work.model.num_hidden_layers, pp)
    layout = replace(layout, layer_memory=(), recompute="none")
    chosen: list[str] = []
    for p in range(pp):
        by_mode: dict[str, list[ModeCost]] = {mode: [] for mode in modes}
        device, host = np.inf, np.inf
        for d in range(dp):
            g = GroupModel(cluster, work, methods, splits, [rank_of(d, p, i, pp, mp) for i in range(mp)], rows)
            before, after, in_flight, acts_edge, gathered = memory_terms(g, layout, p, params[p], partial[p],
                                                                         replicated[p])
            budget = np.array([cluster.ranks[r].memory_bytes for r in g.ranks], dtype=float)
            if after is None or (after + gathered <= budget).all():
                device = min(device, float(((budget - gathered - before) / in_flight - acts_edge)[0].min()))
            else:
                device = -np.inf  # the optimizer step alone does not fit
            host = min([host] + [r.host_memory_bytes / in_flight for r in map(cluster.ranks.__getitem__, g.ranks)
                                 if r.host_memory_bytes is not None])
            bandwidth = np.array([cluster.ranks[r].host_link_bytes_per_s for r in g.ranks], dtype=float)
            for mode in modes:
                by_mode[mode].append(layer_mode_cost(g, mode, bandwidth))
        options = [ModeCost(mode, *(max(float(np.max(np.atleast_2d(getattr(c, f))[0])) for c in costs)
                                    for f in COST_TERMS)) for mode, costs in by_mode.items()]
        chosen += choose_layer_memory(options, stage_layers[p], device, host)
    return replace(layout, layer_memory=tuple(chosen), recompute="none")


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
