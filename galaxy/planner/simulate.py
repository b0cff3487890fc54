"""Predicted step time (training) or single-request latency (batch-1 forward) and per-rank memory
of a plan, from a cluster profile: each rank runs its pieces at its own measured speed, and every
collective is a sync point of its group (the slowest member sets when it starts).

All predictions are vectorised over candidate splits: ``Splits`` holds ``[candidates, mp]`` arrays,
so the search scores thousands of splits in one pass. A step is simulated as the training loop runs
it: optimizer (each rank's own), the micro-batches' forward and backward, the data-parallel and
model-parallel gradient sums and the global grad-norm all-reduce (the step's last sync point).
Pipelines (pp > 1) use the usual schedule bound: the sum of the stages' times plus (micro-batches
- 1) times the slowest stage. CoC overlap is not modelled (plans are scored with one chunk).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from galaxy.config import OFFLOAD, Method, balanced_split
from galaxy.core.context import rank_of
from galaxy.planner.cluster import ClusterProfile
from galaxy.planner.group import RECOMPUTED, Collective, Compute, GroupModel, Ring, Segments, run
from galaxy.planner.memory import (FsdpUnits, host_memory, partial_gradient_bytes, stage_mode_costs, stage_parameters,
                                   training_memory)
from galaxy.planner.workload import Layout, Splits, Workload, fsdp_reshards, fsdp_syncs_once, tied_params

GRAD_BUCKET_BYTES = 25 * 2**20  # GradientSync's bucket size
# bytes the profile's fused AdamW step moves per fp32 parameter (reads the weight, gradient and both moments,
# writes three): its seconds per parameter over this are the device's seconds per byte of a memory-bound copy
ADAMW_BYTES_PER_PARAM = 28


@dataclass
class Prediction:
    time_s: np.ndarray  # [candidates]
    memory_bytes: np.ndarray  # [candidates, world]
    fits: np.ndarray  # [candidates]: every rank within its memory budget
    detail: dict = field(default_factory=dict)

def fsdp_exposed(cluster: ClusterProfile, work: Workload, layout: Layout, kinds: list[FsdpUnits],
                 compute_s: np.ndarray) -> np.ndarray:
    """``[C, mp]`` seconds FSDP adds to a step's micro-batches of a stage's ranks, whose units are
    ``kinds`` (``FsdpUnits.of``), against each micro-batch's ``compute_s``. Each layer's weights are
    all-gathered in the compute dtype before it runs (again in backward where resharded after forward:
    FSDP2's default without a pipeline) and its gradients reduce-scattered in the master precision after
    its backward (in the last micro-batch only with ``fsdp_grad_sync: last_micro_batch``); the root
    (embeddings, head) gathers in the master precision and reduce-scatters likewise. FSDP issues a
    unit's collectives behind its neighbours' compute, so a micro-batch waits for the root's and the
    first layer's gathers, the last reduce-scatters, and whatever of the rest its compute cannot cover:
    on NVLink a few milliseconds, on a slow link most of the traffic. Its copies around them
    (``fsdp_copy_bytes``) run on the device beside the compute and cost their bytes at the slowest
    member's memory-bound rate."""
    M = layout.microbatches
    gathers = 2 if fsdp_reshards(work.reshard_after_forward, layout.pp) else 1
    once = fsdp_syncs_once(work.fsdp_grad_sync, M)
    out = np.zeros_like(compute_s, dtype=float)
    for i in range(compute_s.shape[1]):
        # per micro-batch, with and without its gradient reduce-scatters: what it waits for, all it moves
        waited, traffic, copies = {True: 0.0, False: 0.0}, {True: 0.0, False: 0.0}, 0.0
        for u in kinds:
            ranks = list(u.groups[i])
            ag, rs = cluster.collective(ranks, "all_gather"), cluster.collective(ranks, "reduce_scatter")
            per_layer, edge = u.per_layer[:, i], np.full_like(u.per_layer[:, i], u.edge * u.master)
            gather, reduce = ag(per_layer * u.compute), rs(per_layer * u.master)
            root_gather, root_reduce = (ag(edge), rs(edge)) if u.edge else (0.0, 0.0)
            for reduces in (True, False):
                r = 1.0 if reduces else 0.0
                waited[reduces] = waited[reduces] + root_gather + gather + r * (root_reduce + reduce)
                traffic[reduces] = traffic[reduces] + u.layers * (gathers * gather + r * reduce) + root_gather \
                    + r * root_reduce
            copy_s_per_byte = max(cluster.ranks[r].optimizer.beta_s_per_byte for r in ranks) / ADAMW_BYTES_PER_PARAM
            copies = copies + copy_s_per_byte * sum(
                u.layers * fsdp_copy_bytes(per_layer, u.compute, u.master, len(ranks), gathers, k, M, once)
                + fsdp_copy_bytes(np.full_like(per_layer, u.edge), u.master, u.master, len(ranks), 1, k, M, once)
                for k in range(M))

        def micro_batch(reduces: bool) -> np.ndarray:
            return waited[reduces] + np.maximum(0.0, traffic[reduces] - waited[reduces] - compute_s[:, i])
        out[:, i] = micro_batch(True) + (M - 1) * micro_batch(not once) + copies
    return out


def fsdp_copy_bytes(n: np.ndarray, held: int, master: int, dp: int, gathers: int, k: int, M: int,
                    once: bool) -> np.ndarray:
    """Bytes FSDP2 reads and writes around the collectives of ``n`` weights (``held`` bytes each gathered,
    ``master`` bytes each sharded, over ``dp`` ranks) in micro-batch ``k`` of ``M``: per gather the shard
    cast to the compute dtype where that differs and copied into the gather's input buffer, and the
    gathered buffer split into the weights; the gradients cast into the master precision, into the
    reduce-scatter's input, and after the first micro-batch the reduced shard added to the sharded
    gradient (the first keeps it as it is). ``once`` (``fsdp_grad_sync: last_micro_batch``): the
    gradients cast into an unsharded accumulator in the master precision, added to it from the second
    micro-batch on (a gradient in that precision already, autograd accumulates itself), and the
    accumulator copied into the reduce-scatter's input in the last."""
    cast = n / dp * (master + held) if held != master else 0
    gathered = gathers * (cast + n / dp * 2 * held + 2 * n * held)
    if not once:
        return gathered + n * (held + master) + (3 * n / dp * master if k else 0)
    accumulated = n * (held + master) + (n * master if k else 0) if held != master else 0
    return gathered + accumulated + (2 * n * master if k == M - 1 else 0)

def predict(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method], splits: Splits,
            layout: Layout = Layout(), segments: Optional[Segments] = None) -> Prediction:
    """Step time (objective 'train') or batch-1 forward latency ('latency'), and memory per rank.
    ``segments`` (dp = pp = 1 only) records the stretches between sync points."""
    m = work.model
    dp, pp, M = layout.dp, layout.pp, layout.microbatches
    world = cluster.world
    if world % (dp * pp):
        raise ValueError(f"dp x pp = {dp * pp} does not divide the world of {world}")
    mp = world // (dp * pp)
    latency = work.objective == "latency"
    rows = 1 if latency else work.global_batch // (dp * M)
    C = splits.seq.shape[0]
    stage_layers = balanced_split(m.num_hidden_layers, pp)
    groups = {(d, p): GroupModel(cluster, work, methods, splits,
                                 [rank_of(d, p, i, pp, mp) for i in range(mp)], rows)
              for d in range(dp) for p in range(pp)}
    if segments is not None:
        if dp * pp != 1:
            raise ValueError("segments are recorded for dp = pp = 1 only")
        groups[(0, 0)].segments = segments
    params, partial, stepped, replicated = stage_parameters(work, methods, splits, layout, mp)

    memory, host = np.zeros((C, world)), np.zeros((C, world))
    detail = {}
    if latency:
        g = groups[(0, 0)]
        layer, head_ev = g.layer(), g.head()
        clock = np.tile([cluster.ranks[r].forward_overhead_s for r in g.ranks], (C, 1))
        clock = g.repeat(lambda c: run(g, layer, c), clock, m.num_hidden_layers)
        clock = run(g, head_ev, clock)
        if segments is not None:
            segments.finish(clock)
        time = clock.max(axis=1)
        working = max((e.act for e in layer + head_ev if isinstance(e, Compute)), key=lambda a: a.sum())
        memory[:, g.ranks] = params[0] * work.elem + working
        return _finish(cluster, time, memory, detail)

    opt = {r: cluster.ranks[r].optimizer for r in range(world)}
    grad_bytes = 8 if work.dtype == "float64" else 4  # gradients are reduced in the master weights' precision
    zero1 = dp > 1 and work.dp_engine == "zero1"  # optimizer state and step split over dp
    fsdp = dp > 1 and work.dp_engine == "fsdp2"
    sharded = mp > 1 and work.mp_grad_reduce == "sharded"
    stage_f, stage_b = np.zeros((pp, C)), np.zeros((pp, C))
    clocks = {}
    for (d, p), g in groups.items():
        layer, head_ev = g.layer(), g.head()
        edge = head_ev if p == pp - 1 else []
        memory[:, g.ranks] = training_memory(g, layout, p, params[p], partial[p], replicated[p])
        host[:, g.ranks] = host_memory(g, layout, p)
        fsdp_units = FsdpUnits.of(work, layout, p, params[p], replicated[p], d)
        modes = layout.stage_modes(stage_layers, p)
        runs = [(mode, len(list(same))) for mode, same in itertools.groupby(modes)]  # layers in a row alike
        costs = dict(zip(dict.fromkeys(modes), stage_mode_costs(g, layout, p)[0]))

        def layer_forward(clock, mode, g=g, layer=layer, costs=costs):
            return run(g, layer, clock) + costs[mode].exposed_fwd_s

        def layer_backward(clock, mode, g=g, layer=layer, costs=costs):
            recompute = mode[: -len(OFFLOAD)] if mode.endswith(OFFLOAD) else mode
            if recompute == "full":
                clock = run(g, layer, clock)
            elif recompute in RECOMPUTED:
                clock = clock + sum(e.fwd for e in layer if isinstance(e, Compute)
                                    and e.name.startswith(RECOMPUTED[recompute]))
            return run(g, layer, clock + costs[mode].exposed_bwd_s, backward=True)

        def fwd_bwd(clock, g=g, edge=edge, runs=runs):
            for mode, count in runs:
                clock = g.repeat(lambda c: layer_forward(c, mode), clock, count)
            clock = run(g, edge, clock)
            f_end = clock
            clock = run(g, edge, clock, backward=True)
            for mode, count in reversed(runs):
                clock = g.repeat(lambda c: layer_backward(c, mode), clock, count)
            return f_end, clock

        if pp == 1:
            start = np.stack([opt[r](stepped[0][:, i]) + cluster.ranks[r].step_overhead_s
                              for i, r in enumerate(g.ranks)], axis=1)
            clock = g.repeat(lambda c: fwd_bwd(c)[1], start, M)
            if fsdp_units:
                clock = clock + fsdp_exposed(cluster, work, layout, fsdp_units, (clock - start) / M)
            clocks[(d, p)] = clock
        else:
            f_end, b_end = fwd_bwd(np.zeros((C, mp)))
            if fsdp_units:  # the pipeline runs each micro-batch's share
                b_end = b_end + fsdp_exposed(cluster, work, layout, fsdp_units, b_end) / M
            f = f_end.max(axis=1)
            stage_f[p] = np.maximum(stage_f[p], f)
            stage_b[p] = np.maximum(stage_b[p], b_end.max(axis=1) - f)

    if pp > 1:
        for p in range(pp - 1):  # each boundary sends the stream forward and its gradient back
            for d in range(dp):
                a, b = groups[(d, p)], groups[(d, p + 1)]
                send = np.stack([cluster.p2p(a.ranks[i], b.ranks[i])(rows * a.tokens[:, i] * m.hidden_size * work.elem)
                                 for i in range(mp)], axis=1).max(axis=1)
                stage_f[p] = stage_f[p] + send
                stage_b[p + 1] = stage_b[p + 1] + send
        per_stage = stage_f + stage_b
        pipe = per_stage.sum(axis=0) + (M - 1) * per_stage.max(axis=0)
        opt_max = np.zeros(C)
        for (d, p), g in groups.items():
            for i, r in enumerate(g.ranks):
                opt_max = np.maximum(opt_max, opt[r](stepped[p][:, i]) + cluster.ranks[r].step_overhead_s)
        clocks = {k: np.repeat((opt_max + pipe)[:, None], mp, axis=1) for k in groups}
        detail["bubble"] = 1 - per_stage.sum(axis=0) * M / pp / np.maximum(pipe, 1e-30)

    # After the backward, in the order a step issues them (galaxy.train.loop): the dp sum of every
    # gradient, the mp sum of PARTIAL gradients (per mp_grad_reduce), the tied-embedding sum between
    # the pipeline's ends, the loss (dp sum, pp broadcast), the gradient norm (mp, then pp), and
    # after the optimizer ZeRO-1's broadcasts over dp / sharded mode's all-gather over mp.
    sent = np.zeros(C)  # global rank 0's bytes of a step, as galaxy.core.comm records them
    g0 = groups[(0, 0)]
    for events, times in ((g0.layer(), stage_layers[0]), (g0.head() if pp == 1 else [], 1)):
        for e in events:
            if isinstance(e, Ring):
                sent += times * M * sum(nbytes for _, nbytes, _ in e.records(0))
            elif isinstance(e, Collective):
                back = e.nbytes if e.bwd_nbytes is None else e.bwd_nbytes
                sent += times * M * (e.nbytes * (e.fwd_op is not None) + back * (e.bwd_op is not None))
    if pp > 1:  # stage 0 sends each micro-batch's stream forward (what it receives is not counted)
        sent += M * rows * g0.tokens[:, 0] * m.hidden_size * work.elem
    sent += sum((u.step_bytes(work, layout)[:, 0] for u in FsdpUnits.of(work, layout, 0, params[0], replicated[0])),
                np.zeros(C))

    def sync(keys: list[tuple[int, int, int]], op: str, nbytes, buckets=1) -> None:
        """One collective over the ranks ``(d, p, i)`` of ``keys``: all leave when the last arrives."""
        nonlocal sent
        if len(keys) < 2:
            return
        ranks = [groups[(d, p)].ranks[i] for d, p, i in keys]
        ab = cluster.collective(ranks, op)
        cost = np.broadcast_to(buckets * ab(np.asarray(nbytes, dtype=float) / buckets), (C,))
        start = np.max([clocks[(d, p)][:, i] for d, p, i in keys], axis=0)
        d0, p0, _ = keys[0]
        g = groups[(d0, p0)]
        record = g.segments is not None and len(keys) == mp and all((d, p) == (d0, p0) for d, p, _ in keys)
        before = clocks[(d0, p0)].copy() if record else None
        for d, p, i in keys:
            clocks[(d, p)][:, i] = start + cost
        if record:
            g.segments.sync(before, cost[:, None], clocks[(d0, p0)])
        if (0, 0, 0) in keys:
            sent = sent + nbytes

    def mp_keys(d, p):
        return [(d, p, i) for i in range(mp)]

    partial_bytes = {p: partial_gradient_bytes(work, partial[p][:, 0], dp) for p in range(pp)}
    buckets = {p: np.maximum(np.ceil(partial_bytes[p] / GRAD_BUCKET_BYTES), 1) for p in range(pp)}
    # FSDP2's gathers and reduce-scatters over dp ran inside the micro-batches (``fsdp_exposed``)
    if dp > 1 and not fsdp:
        for p in range(pp):
            for i in range(mp):  # a sharded PARTIAL bucket's dp sum moves this rank's piece only, as an FSDP shard's
                local = params[p][:, i] - (partial[p][:, i] * (1 - 1 / mp) if sharded else 0) \
                    - replicated[p][:, i] * (1 - 1 / mp)
                sync([(d, p, i) for d in range(dp)], "all_reduce", local * grad_bytes)
    for (d, p) in groups:
        if mp > 1 and partial_bytes[p].max() > 0:
            sync(mp_keys(d, p), "reduce_scatter" if sharded else "all_reduce", partial_bytes[p], buckets[p])
    tied = tied_params(m) if pp > 1 else 0
    for d in range(dp):
        for i in range(mp):
            if tied:
                sync([(d, 0, i), (d, pp - 1, i)], "all_reduce", tied * grad_bytes)
    for i in range(mp):
        for _ in range(2):  # the loss-target count and the loss, summed over dp on the last stage
            sync([(d, pp - 1, i) for d in range(dp)], "all_reduce", 8)
        for d in range(dp):  # the loss, broadcast from the last stage
            sync([(d, p, i) for p in range(pp)], "all_reduce", 8)
    for (d, p) in groups:  # the squared gradient norm: over mp, then over pp (FSDP2: over dp first)
        if fsdp and d == 0:
            for i in range(mp):
                sync([(e, p, i) for e in range(dp)], "all_reduce", 8)
        if mp > 1:
            sync(mp_keys(d, p), "all_reduce", 8)
    for d in range(dp):
        for i in range(mp):
            sync([(d, p, i) for p in range(pp)], "all_reduce", 8)
    for (d, p) in groups:  # after the optimizer: the updated weights gathered back
        if sharded and partial_bytes[p].max() > 0:
            sync(mp_keys(d, p), "all_gather", partial_bytes[p], buckets[p])
    if zero1:
        for p in range(pp):
            for i in range(mp):
                sync([(d, p, i) for d in range(dp)], "all_gather", params[p][:, i] * grad_bytes)
    end = np.zeros(C)
    for (d, p), g in groups.items():
        if g.segments is not None:
            g.segments.finish(clocks[(d, p)])
        end = np.maximum(end, clocks[(d, p)].max(axis=1))
    detail["comm_bytes"] = sent
    detail["host_bytes"] = host
    return _finish(cluster, end, memory, detail)


def _finish(cluster: ClusterProfile, time: np.ndarray, memory: np.ndarray, detail: dict) -> Prediction:
    budget = np.array([r.memory_bytes for r in cluster.ranks], dtype=float)
    fits = (memory <= budget).all(axis=1)
    if "host_bytes" in detail:  # offloaded layers within each rank's host memory
        host_budget = np.array([np.inf if r.host_memory_bytes is None else r.host_memory_bytes
                                for r in cluster.ranks], dtype=float)
        fits = fits & (detail["host_bytes"] <= host_budget).all(axis=1)
    return Prediction(time, memory, fits, detail)
