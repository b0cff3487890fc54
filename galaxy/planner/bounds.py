"""Lower bounds over every split that let the search leave out what cannot change its answer: a plan's
least step time over its splits (``lower_bound``, against ``simulate.predict``) and a proof that no split
fits the memory budgets (``might_fit``, against ``memory.training_memory``).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from galaxy.config import Method, balanced_split
from galaxy.core.context import rank_of
from galaxy.planner.cluster import ClusterProfile
from galaxy.planner.group import RECOMPUTED, Compute, GroupModel
from galaxy.planner.memory import partial_gradient_bytes, stage_parameters, training_memory
from galaxy.planner.simulate import GRAD_BUCKET_BYTES
from galaxy.planner.workload import Layout, Splits, Workload

BOUND_POINTS = 256  # shares of a split variable at which the bound evaluates its pieces (every share when fewer)
SIZED_BY = {"heads": ("att_proj.heads", "att_core.heads"), "ffn": ("mlp.ffn",),
            "seq": ("att_proj.tokens", "att_core.tokens", "mlp.tokens", "con.tokens", "head.tokens")}


def bound_points(cluster: ClusterProfile, var: str, unit: int, count: int, most: int = BOUND_POINTS,
                 memory: bool = False) -> np.ndarray:
    """Shares (in units, ascending, from 1 to ``count``) at which ``lower_bound`` evaluates the pieces
    that ``var`` sizes (their saved bytes, for ``memory``): every share when at most ``most``; else
    ``most`` evenly spaced ones and both neighbours of every knot of those pieces' curves, so that each
    piece is linear between two consecutive points (up to its clamp at zero) and its least value
    between them is at one of the two."""
    if count <= most:
        return np.arange(1, count + 1)
    knots = set()
    for rank in cluster.ranks:
        for size in rank.knots(SIZED_BY[var], memory):
            knots.update((math.floor(size / unit), math.ceil(size / unit)))
    inside = [k for k in knots if 1 <= k <= count]
    return np.unique(np.concatenate([np.linspace(1, count, most).round(), inside])).astype(np.int64)


def least_makespan(table: np.ndarray, weights: np.ndarray, units: int) -> float:
    """A lower bound on ``min over splits x of max_i cost_i(x_i)`` (each rank at least one unit, ``units``
    in all), where ``table[k, i]`` is at most rank i's cost at any share of bucket k and bucket k holds
    ``weights[k]`` consecutive shares, the buckets in ascending order and covering 1..units. Each
    column is replaced by its running minimum from the end (non-decreasing, still below the costs);
    then a makespan T lets rank i take every share of the buckets up to T, and the least T that lets
    the ranks take ``units`` between them is the ``units``-th smallest share cost."""
    env = np.minimum.accumulate(table[::-1], axis=0)[::-1]
    values = env.ravel()
    order = np.argsort(values, kind="stable")
    taken = np.cumsum(np.repeat(weights, table.shape[1])[order])
    kth = values[order[min(int(np.searchsorted(taken, units)), len(order) - 1)]]
    return float(max(env[0].max(), kth))


class _Program:
    """One group's step as the bound walks it: compute items (a key and its per-rank table over the
    bound's points), sync items (a key, seconds until the waiting members leave, until the last to
    arrive leaves) and repeated blocks."""

    def __init__(self, probe: GroupModel, balanced: GroupModel, buckets: dict[str, np.ndarray],
                 recompute: str, edge: bool):
        self.tables: dict[tuple, tuple[Optional[str], np.ndarray]] = {}
        self.buckets = buckets
        layer, bal_layer = probe.layer(), balanced.layer()
        head, bal_head = (probe.head(), balanced.head()) if edge else ([], [])
        forward = self.items("L", layer, balanced, bal_layer, False)
        back = self.items("L", layer, balanced, bal_layer, True)
        if recompute == "full":
            back = forward + back
        elif recompute in RECOMPUTED:
            back = [it for it in forward
                    if it[0] == "c" and layer[it[1][1]].name.startswith(RECOMPUTED[recompute])] + back
        self.layer_forward, self.layer_backward = forward, back
        self.edge_forward = self.items("H", head, balanced, bal_head, False)
        self.edge_backward = self.items("H", head, balanced, bal_head, True)

    def items(self, where: str, events: list, balanced: GroupModel, balanced_events: list, backward: bool) -> list:
        """``events`` (the probe's) as items; collectives timed at ``balanced``'s bytes."""
        out = []
        for k, (e, b) in enumerate(zip(events, balanced_events)):
            if isinstance(e, Compute):
                key = (where, k, "b" if backward else "f")
                if key not in self.tables:
                    values = e.bwd if backward else e.fwd
                    if e.var in self.buckets:
                        points = values[:len(self.buckets[e.var])]
                        self.tables[key] = (e.var, np.concatenate([np.minimum(points[:-1], points[1:]),
                                                                   points[-1:]]))
                    else:
                        self.tables[key] = (None, values[0])
                out.append(("c", key))
            else:
                op = b.bwd_op if backward else b.fwd_op
                if op is not None:
                    wire = b.wire if b.least_wire is None else b.least_wire
                    waited, slowest = (float(t[0]) for t in balanced.link_seconds(op, wire))
                    out.append(("s", (where, k, "b" if backward else "f"), waited, slowest))
        return out[::-1] if backward else out


def _has_sync(items: list) -> bool:
    return any(it[0] == "s" or (it[0] == "rep" and it[2] > 0 and _has_sync(it[1])) for it in items)


class _Walk:
    """Walks a program through the barrier relaxation of the simulation. At a sync the last member
    to arrive leaves ``slowest`` after its arrival and the others ``waited`` after it; so the next
    sync's last arrival comes at least ``waited`` + the largest compute between, and at least
    ``slowest`` + the smallest (the last member's own) after this one's. Minimising each stretch over
    the splits on its own (``least_makespan`` per variable, every other variable at its least
    cost) bounds every split's step from below. Stretches of repeated blocks are scored once."""

    def __init__(self, program: _Program, units: dict[str, tuple[int, int]], weights: dict[str, np.ndarray],
                 start: np.ndarray):
        self.program, self.units, self.weights, self.start = program, units, weights, start
        self.memo: dict = {}

    def stretch(self, open_: dict, prev: Optional[tuple], first: bool) -> float:
        key = (frozenset(open_.items()), prev[0] if prev else None, first)
        if key in self.memo:
            return self.memo[key]
        by_var: dict[str, np.ndarray] = {}
        const = self.start.copy() if first else np.zeros_like(self.start)
        for item, count in open_.items():
            var, table = self.program.tables[item]
            if var is None:
                const = const + count * table
            else:
                by_var[var] = by_var.get(var, 0) + count * table
        least = {v: np.minimum.accumulate(t[::-1], axis=0)[-1] for v, t in by_var.items()}  # per rank, any share
        base = const + sum(least.values(), np.zeros_like(const))
        makespan = max([least_makespan(t + (base - least[v])[None, :], self.weights[v], self.units[v][1])
                        for v, t in by_var.items()] or [float(base.max())])
        value = makespan if prev is None else max(prev[1] + makespan, prev[2] + float(base.min()))
        self.memo[key] = value
        return value

    def run(self, items: list, state: tuple) -> tuple[float, tuple]:
        """(the bound's seconds of ``items``, the state after): state = (open stretch as item -> count,
        the last sync item, whether the stretch holds the step's start)."""
        total = 0.0
        open_, prev, first = state
        for item in items:
            if item[0] == "c":
                open_ = {**open_, item[1]: open_.get(item[1], 0) + 1}
            elif item[0] == "s":
                total += self.stretch(open_, prev, first)
                open_, prev, first = {}, item[1:], False
            else:
                _, block, times = item
                if times == 0:
                    continue
                once, after = self.run(block, (open_, prev, first))
                if times > 1 and _has_sync(block):  # every pass after the first starts where the second did
                    again, after = self.run(block, after)
                    once += (times - 1) * again
                elif times > 1:  # compute only: the open stretch grows by the same each pass
                    grown = after[0]
                    after = ({k: open_.get(k, 0) + times * (grown.get(k, 0) - open_.get(k, 0)) for k in grown},
                             prev, first)
                total += once
                open_, prev, first = after
        return total, (open_, prev, first)

    def finish(self, items: list) -> float:
        total, (open_, prev, first) = self.run(items, ({}, None, True))
        return total + self.stretch(open_, prev, first)


def lower_bound(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method], layout: Layout,
                units: dict[str, tuple[int, int]], uses: tuple[str, ...]) -> float:
    """Seconds that no split of ``methods`` under ``layout`` beats in ``predict`` (memory budgets
    ignored). ``units``: per split variable (heads, ffn, seq) its unit and count of units; ``uses``:
    the variables the split search varies (the others balanced).

    Each group's step is bounded by ``_Walk`` from below (its compute at its least over the shares,
    the collectives at the balanced split's bytes, which no split lowers: uneven pieces are padded
    to the largest). With one stage the step is at least any group's clocks after its micro-batches
    (the syncs after only add); with a pipeline at least the optimizer, the sum of the stages' bounds
    and (micro-batches - 1) times the largest (the sends add). Of the syncs after the backward it
    counts a group's own (``predict``'s mp-group sums of PARTIAL gradients, the norm, sharded mode's
    gather), whose bytes no split changes; the others only add."""
    m = work.model
    dp, pp, M = layout.dp, layout.pp, layout.microbatches
    mp = cluster.world // (dp * pp)
    latency = work.objective == "latency"
    rows = 1 if latency else work.global_batch // (dp * M)
    points = {v: bound_points(cluster, v, *units[v]) for v in uses}
    weights = {v: np.append(np.diff(p), 1) for v, p in points.items()}
    C = max((len(p) for p in points.values()), default=1)

    def column(var: str) -> np.ndarray:
        unit, count = units[var]
        if var in points:
            shares = np.pad(points[var], (0, C - len(points[var])), mode="edge")
            return np.repeat(shares[:, None] * unit, mp, axis=1)
        return np.tile(balanced_split(count * unit, mp), (C, 1))

    probe = Splits(column("heads"), column("ffn"), column("seq"))
    even = Splits.one(*(balanced_split(units[v][0] * units[v][1], mp) for v in ("heads", "ffn", "seq")))
    stage_layers = balanced_split(m.num_hidden_layers, pp)
    partial = stage_parameters(work, methods, even, layout, mp)[1]  # PARTIAL weights: the same on every split
    stepped = stage_parameters(work, methods, probe, layout, mp)[2]  # row 0: every share at its least
    sharded = mp > 1 and work.mp_grad_reduce == "sharded"

    def tail(ranks: list[int], p: int) -> list:
        """The group's own syncs after the backward, as sync items (every member leaves together)."""
        if mp == 1 or latency:
            return []
        nbytes = float(partial_gradient_bytes(work, partial[p][0, 0], dp))
        buckets = max(math.ceil(nbytes / GRAD_BUCKET_BYTES), 1)
        syncs = [("reduce_scatter" if sharded else "all_reduce", nbytes)] if nbytes > 0 else []
        syncs += [("all_reduce", 8.0)] + ([("all_gather", nbytes)] if sharded and nbytes > 0 else [])
        out = []
        for k, (op, size) in enumerate(syncs):
            n = buckets if size == nbytes else 1
            cost = float(n * cluster.collective(ranks, op)(size / n))
            out.append(("s", ("T", k, op), cost, cost))
        return out

    def group_bound(d: int, p: int, start: np.ndarray, micro_batches: int) -> float:
        ranks = [rank_of(d, p, i, pp, mp) for i in range(mp)]
        prog = _Program(GroupModel(cluster, work, methods, probe, ranks, rows),
                        GroupModel(cluster, work, methods, even, ranks, rows), points,
                        # per-layer memory modes only add time: the bound runs them without
                        "none" if latency or layout.layer_memory else layout.recompute, latency or p == pp - 1)
        L = stage_layers[p]
        if latency:
            items = [("rep", prog.layer_forward, L)] + prog.edge_forward
        else:
            items = [("rep", [("rep", prog.layer_forward, L)] + prog.edge_forward + prog.edge_backward
                      + [("rep", prog.layer_backward, L)], micro_batches)]
        return _Walk(prog, units, weights, start).finish(items + (tail(ranks, p) if pp == 1 else []))

    if latency:
        return group_bound(0, 0, np.array([cluster.ranks[r].forward_overhead_s for r in range(mp)]), 1)
    def optimizer(d: int, p: int) -> np.ndarray:
        """Each rank's optimizer step and overhead, at its least parameters (the optimizer's time grows with them)."""
        return np.array([float(cluster.ranks[r].optimizer(stepped[p][0, i])) + cluster.ranks[r].step_overhead_s
                         for i, r in enumerate(rank_of(d, p, i, pp, mp) for i in range(mp))])

    if pp == 1:
        return max(group_bound(d, 0, optimizer(d, 0), M) for d in range(dp))
    stages = [max(group_bound(d, p, np.zeros(mp), 1) for d in range(dp)) for p in range(pp)]
    optimizer = max(optimizer(d, p).max() for d in range(dp) for p in range(pp))
    after = max(sum(item[2] for item in tail([rank_of(0, p, i, pp, mp) for i in range(mp)], p)) for p in range(pp))
    return optimizer + sum(stages) + (M - 1) * max(stages) + after


def convex_hull_slopes(x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """The lower convex hull of the points (``x`` ascending): its value at ``x[0]``, and the slopes
    and widths of its segments (slopes ascending)."""
    hull: list[int] = []
    for k in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (y[b] - y[a]) * (x[k] - x[a]) >= (y[k] - y[a]) * (x[b] - x[a]):  # b on or above the chord a-k
                hull.pop()
            else:
                break
        hull.append(k)
    xs, ys = x[hull].astype(float), y[hull]
    return float(ys[0]), np.diff(ys) / np.diff(xs), np.diff(xs)


def might_fit(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method], layout: Layout,
              units: dict[str, tuple[int, int]], uses: tuple[str, ...]) -> bool:
    """False only where no split of ``methods`` under ``layout`` fits every rank's memory budget
    (training). A rank's memory (``training_memory``) is a sum of terms each sized by one split
    variable, each linear between the ``bound_points`` of its variable (where a saved-bytes curve is
    clamped at zero between two of them, nothing is claimed); so for each group and each variable the
    shares are scored at those points with every other variable at one unit. No split
    fits where some rank's least memory over its shares is above its budget, where every split of one
    variable (the others at their least) leaves a rank above its budget (``least_makespan`` of the
    overruns), or where the group's least total is above the group's budgets together: the least
    total gives each rank the lower convex hull of its own terms and hands out the units by
    increasing marginal cost, which no split's total undercuts."""
    if work.objective != "train":
        return True
    dp, pp = layout.dp, layout.pp
    mp = cluster.world // (dp * pp)
    rows = work.global_batch // (dp * layout.microbatches)
    points = {v: bound_points(cluster, v, *units[v], memory=True) for v in uses}
    blocks, at = {}, 1
    for v in uses:
        blocks[v] = slice(at, at + len(points[v]))
        at += len(points[v])

    def column(var: str) -> np.ndarray:
        unit, count = units[var]
        if var not in points:
            return np.tile(balanced_split(count * unit, mp), (at, 1))
        shares = np.ones(at, dtype=np.int64)
        shares[blocks[var]] = points[var]
        return np.repeat(shares[:, None] * unit, mp, axis=1)

    probe = Splits(column("heads"), column("ffn"), column("seq"))
    params, partial, _, replicated = stage_parameters(work, methods, probe, layout, mp)
    budget = np.array([r.memory_bytes for r in cluster.ranks], dtype=float)
    for d in range(dp):
        for p in range(pp):
            ranks = [rank_of(d, p, i, pp, mp) for i in range(mp)]
            g = GroupModel(cluster, work, methods, probe, ranks, rows)
            for e in g.layer() + g.head():  # a saved-bytes curve clamped at zero between two points bends there
                if isinstance(e, Compute) and e.var in points and len(points[e.var]) < units[e.var][1]:
                    positive = e.act[blocks[e.var]] > 0
                    if (positive[1:] != positive[:-1]).any():
                        return True
            memory = training_memory(g, layout, p, params[p], partial[p], replicated[p])
            ones = memory[0]
            terms = {v: memory[blocks[v]] - ones for v in uses}  # [points, mp]: each variable's own part
            least = ones + sum((t.min(axis=0) for t in terms.values()), np.zeros(mp))
            if (least > budget[ranks]).any():
                return False
            for v, t in terms.items():  # the least over v's splits of the largest overrun, the others at their least
                over = t + (least - t.min(axis=0) - budget[ranks])[None, :]
                buckets = np.concatenate([np.minimum(over[:-1], over[1:]), over[-1:]])
                if least_makespan(buckets, np.append(np.diff(points[v]), 1), units[v][1]) > 0:
                    return False
            total = ones.sum()
            for v, t in terms.items():
                start, slopes, widths = zip(*(convex_hull_slopes(points[v], t[:, i]) for i in range(mp)))
                total += sum(start)
                slopes, widths = np.concatenate(slopes), np.concatenate(widths)
                order = np.argsort(slopes, kind="stable")
                left = units[v][1] - mp  # every rank holds one unit already
                before = np.concatenate([[0], np.cumsum(widths[order])[:-1]])  # units handed out before each
                taken = np.minimum(widths[order], np.maximum(left - before, 0))
                total += float((slopes[order] * taken).sum())
            if total > budget[ranks].sum():
                return False
    return True
