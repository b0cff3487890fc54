"""The best plan for a cluster: exhaustive over the sets of devices it runs on, block methods (and,
for training, dp x pp x mp, micro-batches and recomputation); per method combination the best
splits under the memory budgets.

Splits are searched in units that keep every shard valid: query heads in multiples of the GQA
group (so key/value heads split with them), FFN columns in multiples of ``ffn_unit``, tokens in
multiples of ``seq_unit``, each rank getting at least one unit. When the joint number of splits is
at most ``EXACT_LIMIT``, every one is scored by the cost model (exact). Otherwise each split starts
from the exact min-max split of its own blocks' per-rank times (bisection on the makespan,
``min_max_split``), then coordinate descent improves one split at a time against the full cost
model, each step exhaustive when its splits are few, else by one-unit moves; the plan is then
marked ``exact: false`` and carries a lower bound on every split's time (``lower_bound``; dp = pp = 1),
so its distance from the optimum is bounded by ``time - lower_bound``.

An uneven split is kept only where it is predicted faster than the even split of the same methods by
more than ``split_margin`` (default 3%): the profiles of two equal devices differ by their noise, and
a split fitted to that noise ran 13% slower than the even one it was predicted to beat by 2.4%
(docs/benchmarks.md, BERT-large 1:1). The even choice then carries the optimum's time as its
``lower_bound_s``. In the same way a plan on more devices comes first only where it is predicted
faster than the best plan on fewer by more than ``device_margin`` (default 3%): every device added
brings its collectives and its noise, and two-device plans predicted 2-3% ahead of one device alone
ran 10-12% behind it (BERT-large 1:1 at 100 Mbit).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from galaxy.config import ConfigError, Method, balanced_split
from galaxy.planner.cluster import ClusterProfile, device_subsets
from galaxy.planner.cost import Layout, Prediction, Splits, Workload, lower_bound, predict

logger = logging.getLogger(__name__)

EXACT_LIMIT = 200_000
SPLIT_MARGIN = 0.03
DEVICE_MARGIN = 0.03
CHUNK = 20_000  # candidates scored in one vectorised pass
METHODS = [(att, con, mlp) for att in (Method.TP, Method.SP, Method.NONE) for con in (Method.SP, Method.NONE)
           for mlp in (Method.TP, Method.SP, Method.NONE)]


@dataclass
class Choice:
    methods: tuple[Method, Method, Method]
    layout: Layout
    heads: tuple[int, ...]
    ffn: tuple[int, ...]
    seq: tuple[int, ...]
    time_s: float
    memory_bytes: tuple[int, ...]
    fits: bool
    exact: bool
    uses: tuple[str, ...] = field(default=())  # which splits the methods use: heads, ffn, seq
    lower_bound_s: Optional[float] = None  # no split of these methods and layout is faster (None: unknown)
    devices: tuple[int, ...] = ()  # the cluster's ranks the plan runs on (rank i of the run on devices[i])

    @property
    def name(self) -> str:
        from galaxy.config import PLAN_PRESETS

        for name, methods in PLAN_PRESETS.items():
            if methods == self.methods:
                return name
        return "/".join(m.value for m in self.methods)


def compositions(units: int, parts: int) -> np.ndarray:
    """Every way to give ``parts`` ranks at least one of ``units`` units: ``[count, parts]``."""
    if parts == 1:
        return np.array([[units]])
    cuts = np.array(list(itertools.combinations(range(1, units), parts - 1)), dtype=np.int64).reshape(-1, parts - 1)
    edges = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), units)], axis=1)
    return np.diff(edges, axis=1)


def count_compositions(units: int, parts: int) -> int:
    return math.comb(units - 1, parts - 1) if units >= parts else 0


def min_max_split(costs: np.ndarray, units: int) -> np.ndarray:
    """Integer split ``x`` (each >= 1, summing to ``units``) minimising ``max_i costs[i, x_i]``,
    where ``costs[i, u]`` is non-decreasing in ``u`` (index 0 unused). A makespan T is feasible when
    every rank can take one unit within it and the largest shares within it add up to ``units``;
    with monotone rows the shares within T count the table's entries up to T, so the smallest
    feasible T is the larger of the ranks' one-unit costs and the ``units``-th smallest entry. Its
    shares, trimmed to ``units``, reach it."""
    parts = costs.shape[0]
    table = costs[:, 1:units + 1]
    makespan = max(table[:, 0].max(), np.partition(table.ravel(), units - 1)[units - 1])
    x = (table <= makespan).sum(axis=1).astype(np.int64)  # monotone rows: a prefix of True
    excess = x.sum() - units
    for i in np.argsort(-x):  # giving back units never raises a rank's cost
        give = min(excess, x[i] - 1)
        x[i] -= give
        excess -= give
    assert x.sum() == units and (x >= 1).all() and parts == len(x)
    return x


class SplitSearch:
    """The best splits of one method combination and layout."""

    def __init__(self, cluster: ClusterProfile, work: Workload, methods, layout: Layout, ffn_unit: int = 1,
                 seq_unit: int = 1, exact_limit: int = EXACT_LIMIT):
        m = work.model
        self.cluster, self.work, self.methods, self.layout = cluster, work, methods, layout
        self.exact_limit = exact_limit
        self.mp = cluster.world // (layout.dp * layout.pp)
        att, con, mlp = methods
        group = m.num_attention_heads // m.kv_heads
        self.units = {"heads": (group, m.num_attention_heads // group),
                      "ffn": (ffn_unit, m.intermediate_size // ffn_unit),
                      "seq": (seq_unit, work.seq_length // seq_unit)}
        uses = []
        if att == Method.TP:
            uses.append("heads")
        if mlp == Method.TP:
            uses.append("ffn")
        if Method.SP in methods:
            uses.append("seq")
        self.uses = tuple(uses) if self.mp > 1 else ()
        self._lower_bound: Optional[float] = None

    def balanced(self) -> dict[str, np.ndarray]:
        """The even split of every variable the methods use, as one candidate."""
        return {v: np.array([balanced_split(self.units[v][1], self.mp)]) for v in self.uses}

    def feasible(self) -> bool:
        return all(self.units[v][1] >= self.mp for v in self.uses)

    def splits(self, chosen: dict[str, np.ndarray]) -> Splits:
        """``chosen[var]``: ``[C, mp]`` unit counts; unused variables balanced."""
        C = max((len(a) for a in chosen.values()), default=1)
        out = {}
        for var, (unit, count) in self.units.items():
            if var in chosen:
                out[var] = chosen[var] * unit
            else:
                out[var] = np.tile(np.array(balanced_split(count * unit, self.mp)), (C, 1))
        return Splits(out["heads"], out["ffn"], out["seq"])

    def score(self, chosen: dict[str, np.ndarray]) -> tuple[Prediction, np.ndarray]:
        pred = predict(self.cluster, self.work, self.methods, self.splits(chosen), self.layout)
        over = (pred.memory_bytes - np.array([r.memory_bytes for r in self.cluster.ranks])).clip(min=0).sum(axis=1)
        key = np.where(pred.fits, pred.time_s, np.inf)
        if not pred.fits.any():  # nothing fits: least memory over the budgets, then time
            key = over * 1e6 + pred.time_s
        return pred, key

    def own_costs(self, var: str) -> np.ndarray:
        """Per-rank forward+backward seconds of the pieces that ``var`` sizes, by unit count."""
        unit, count = self.units[var]
        att, con, mlp = self.methods
        pieces = {"heads": ["att_proj.heads", "att_core.heads"], "ffn": ["mlp.ffn"],
                  "seq": (["att_proj.tokens", "att_core.tokens"] if att == Method.SP else [])
                  + (["mlp.tokens"] if mlp == Method.SP else []) + (["con.tokens"] * 2 if con == Method.SP else [])}[var]
        sizes = np.arange(count + 1) * unit
        costs = np.zeros((self.mp, count + 1))
        rows = 1 if self.work.objective == "latency" else \
            self.work.global_batch // (self.layout.dp * self.layout.microbatches)
        for i in range(self.mp):  # the first group's ranks: a start point, the descent sees every group
            for name in pieces:
                fwd, bwd, _ = self.cluster.ranks[i].piece(name, rows, sizes, self.work.objective == "latency")
                costs[i] += fwd + (0 if self.work.objective == "latency" else bwd)
        return costs

    def run(self) -> Optional[Choice]:
        if not self.feasible():
            return None
        counts = {v: count_compositions(self.units[v][1], self.mp) for v in self.uses}
        exact = math.prod(counts.values()) <= self.exact_limit
        if not self.uses:
            pred, _ = self.score({})
            return self.choice({}, pred, True)
        if exact:
            grids = [compositions(self.units[v][1], self.mp) for v in self.uses]
            total = math.prod(len(g) for g in grids)
            best = None
            for start in range(0, total, CHUNK):
                index = np.unravel_index(np.arange(start, min(start + CHUNK, total)), [len(g) for g in grids])
                chosen = {v: g[index[k]] for k, (v, g) in enumerate(zip(self.uses, grids))}
                pred, key = self.score(chosen)
                i = int(np.argmin(key))
                if best is None or key[i] < best[0]:
                    best = (key[i], {v: a[i:i + 1] for v, a in chosen.items()})
            pred, _ = self.score(best[1])
            return self.choice(best[1], pred, True)
        start = {v: min_max_split(self.own_costs(v), self.units[v][1])[None] for v in self.uses}
        balanced = self.balanced()
        _, keys = self.score({v: np.concatenate([start[v], balanced[v]]) for v in self.uses})
        current = start if keys[0] <= keys[1] else balanced  # the even split may be the better start
        best_key = keys.min()
        changed = {v: 0 for v in self.uses}  # when each variable last moved (steps of the descent)
        scanned = {v: -1 for v in self.uses}  # when each exhaustively scanned variable was last scanned
        step = 0
        for _ in range(20):
            improved = False
            for v in self.uses:
                step += 1
                if counts[v] <= self.exact_limit:
                    if all(changed[w] < scanned[v] for w in self.uses if w != v):
                        continue  # the others are where they were at its last scan: the same optimum
                    scanned[v] = step
                    trial = compositions(self.units[v][1], self.mp)
                else:
                    base = current[v][0]
                    moves = [base + np.eye(self.mp, dtype=np.int64)[j] - np.eye(self.mp, dtype=np.int64)[i]
                             for i in range(self.mp) for j in range(self.mp) if i != j and base[i] > 1]
                    trial = np.array(moves)
                chosen = {w: (trial if w == v else np.repeat(current[w], len(trial), axis=0)) for w in self.uses}
                p, k = self.score(chosen)
                j = int(np.argmin(k))
                if k[j] < best_key * (1 - 1e-12):
                    best_key, improved = k[j], True
                    current = {**current, v: trial[j:j + 1]}
                    changed[v] = step
            if not improved:
                break
        pred, _ = self.score(current)
        choice = self.choice(current, pred, False)
        choice.lower_bound_s = self.lower_bound()
        return choice

    def lower_bound(self) -> float:
        """A time no split of these methods and layout beats (memory budgets ignored): the cost
        model's ``lower_bound``, each stretch between sync points at its least over the splits."""
        if self._lower_bound is None:
            self._lower_bound = lower_bound(self.cluster, self.work, self.methods, self.layout, self.units, self.uses)
        return self._lower_bound

    def even_unless_beaten(self, best: Choice, margin: float) -> Choice:
        """The even split instead of ``best`` where ``best`` is not more than ``margin`` faster."""
        if not self.uses:
            return best
        balanced = self.balanced()
        pred, _ = self.score(balanced)
        even = self.choice(balanced, pred, False)
        if (even.heads, even.ffn, even.seq) == (best.heads, best.ffn, best.seq) \
                or (best.fits and not even.fits) or (even.fits == best.fits and even.time_s > best.time_s * (1 + margin)):
            return best  # (an uneven split that does not fit never displaces an even one that does)
        even.lower_bound_s = best.time_s if best.exact else best.lower_bound_s
        return even

    def choice(self, chosen: dict[str, np.ndarray], pred: Prediction, exact: bool) -> Choice:
        """The Choice for one candidate (``chosen`` rows and ``pred`` of length 1)."""
        s = self.splits(chosen)
        time = float(pred.time_s[0])
        return Choice(self.methods, self.layout, tuple(int(x) for x in s.heads[0]), tuple(int(x) for x in s.ffn[0]),
                      tuple(int(x) for x in s.seq[0]), time, tuple(int(x) for x in pred.memory_bytes[0]),
                      bool(pred.fits[0]), exact, self.uses, time if exact else None)


RECOMPUTE = ("none", "selective", "full")


def layouts(cluster: ClusterProfile, work: Workload) -> list[list[Layout]]:
    """Per dp x pp x mp of the world, its layouts in two tiers: first those worth running for speed
    (one micro-batch without a pipeline, pp or more with one; no recomputation), then the ones that
    only save memory (more micro-batches, down to one row each; selective or full recomputation),
    tried when nothing in the first fits. Micro-batch counts: every divisor of the rows a dp rank
    reads (at least pp of them with a pipeline). ``dp_engine: deepspeed`` runs pure data parallelism:
    dp = the world only. Latency: one layout."""
    if work.objective == "latency":
        return [[Layout()], []]
    out = []
    N, L = cluster.world, work.model.num_hidden_layers
    for dp in range(1, N + 1):
        if N % dp or work.global_batch % dp or (work.dp_engine == "deepspeed" and dp != N):
            continue
        for pp in range(1, N // dp + 1):
            if (N // dp) % pp or pp > L:
                continue
            rows = work.global_batch // dp
            counts = [m for m in range(max(pp, 1), rows + 1) if rows % m == 0]
            if not counts:
                continue
            fast = [Layout(dp, pp, M) for M in (counts[:1] if pp == 1 else counts)]
            frugal = [Layout(dp, pp, M, r) for M in counts for r in RECOMPUTE if Layout(dp, pp, M, r) not in fast]
            out += [fast, frugal]
    return out


def search(cluster: ClusterProfile, work: Workload, ffn_unit: int = 1, seq_unit: int = 1, top: int = 10,
           exact_limit: int = EXACT_LIMIT, split_margin: float = SPLIT_MARGIN,
           device_margin: float = DEVICE_MARGIN) -> list[Choice]:
    """The plans, best first (those within every memory budget before those that are not; the first
    on the fewest devices unless more win by more than ``device_margin``): one per set of devices
    (every subset of the cluster's ranks: on slow links fewer devices can be faster, one alone runs
    the plan 'none'), method combination and dp x pp, with its best micro-batch count and
    recomputation, its splits even unless uneven ones win by more than ``split_margin``."""
    m = work.model
    for key, total, unit in (("ffn_unit", m.intermediate_size, ffn_unit), ("seq_unit", work.seq_length, seq_unit)):
        if unit < 1 or total % unit:
            raise ConfigError(f"--{key} {unit} must be a positive divisor of {total}")
    for key, margin in (("split_margin", split_margin), ("device_margin", device_margin)):
        if not 0 <= margin < 1:
            raise ConfigError(f"--{key} {margin} must be a fraction from 0 to below 1, e.g. 0.03")
    found = []
    for devices in device_subsets(cluster.world):
        sub = cluster.restrict(devices)
        if sub is None:
            logger.info("devices %s skipped: the cluster file has no measurements for their groups", list(devices))
            continue
        for choice in search_devices(sub, work, ffn_unit, seq_unit, exact_limit, split_margin):
            found.append(replace(choice, devices=devices))
    if not found:
        raise ConfigError(f"no plan fits the world of {cluster.world} ranks: the model has too few heads, "
                          "FFN units or tokens for it")
    found.sort(key=lambda c: (not c.fits, c.time_s))
    first = fewest_devices_unless_beaten(found, device_margin)
    return [first] + [c for c in found if c is not first][:top - 1]


def fewest_devices_unless_beaten(ranked: list[Choice], margin: float) -> Choice:
    """The plan to run from ``ranked`` (best first): going up from the fewest devices, the best plan
    on more devices replaces the one so far only where it is faster by more than ``margin``."""
    fitting = [c for c in ranked if c.fits] or ranked[:1]
    chosen = None
    for count in sorted({len(c.devices) for c in fitting}):
        best = next(c for c in fitting if len(c.devices) == count)
        if chosen is None or best.time_s * (1 + margin) < chosen.time_s:
            chosen = best
    return chosen


def search_devices(cluster: ClusterProfile, work: Workload, ffn_unit: int, seq_unit: int,
                   exact_limit: int, split_margin: float) -> list[Choice]:
    """The best plan per method combination and dp x pp on all of ``cluster``'s ranks."""
    tiers = layouts(cluster, work)
    found = []
    for fast, frugal in zip(tiers[::2], tiers[1::2]):
        mp = cluster.world // (fast[0].dp * fast[0].pp)
        for methods in (METHODS if mp > 1 else [(Method.NONE,) * 3]):
            best = None
            for tier in (fast, frugal):
                for layout in tier:
                    splits = SplitSearch(cluster, work, methods, layout, ffn_unit, seq_unit, exact_limit)
                    choice = splits.run()
                    if choice is not None:
                        choice = splits.even_unless_beaten(choice, split_margin)
                    if choice is not None and (best is None or (not choice.fits, choice.time_s)
                                               < (not best.fits, best.time_s)):
                        best = choice
                if best is None or best.fits:  # the memory-saving tier only when nothing fits yet
                    break
            if best is not None:
                found.append(best)
    return found
