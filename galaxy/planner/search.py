"""The best plan for a cluster: exhaustive over the sets of devices it runs on, block methods (and,
for training, dp x pp x mp, micro-batches and recomputation); per method combination the best
splits under the memory budgets. Groups and layouts that cannot change the answer are left out by
bounds on their time and memory over every split (``Pruner``); ``search(prune=False)`` scores all.

Splits are searched in units that keep every shard valid: query heads in multiples of the GQA
group (so key/value heads split with them), FFN columns in multiples of ``ffn_unit``, tokens in
multiples of ``seq_unit``, each rank getting at least one unit. When the joint number of splits is
at most ``EXACT_LIMIT``, every one is scored by the cost model (exact). Otherwise each split starts
from the exact min-max split of its own blocks' per-rank times (bisection on the makespan,
``min_max_split``), then coordinate descent improves one split at a time against the full cost
model, each step exhaustive when its splits are few, else by moves of 1, 2, 4, ... units between two
ranks (it starts from the even split instead where that scores better); the plan is then marked
``exact: false`` and carries a lower bound on every split's time (``bounds.lower_bound``), so its
distance from the optimum is bounded by ``time - lower_bound``.

An uneven split is kept only where it is predicted faster than the even split of the same methods by
more than ``split_margin`` (default 3%): the profiles of two equal devices differ by their noise, and
a split fitted to that noise ran 13% slower than the even one it was predicted to beat by 2.4%
(docs/benchmarks-log.md, BERT-large 1:1). The even choice then carries the optimum's time as its
``lower_bound_s``. In the same way a plan on more devices comes first only where it is predicted
faster than the best plan on fewer by more than ``device_margin`` (default 3%): every device added
brings its collectives and its noise, and two-device plans predicted 2-3% ahead of one device alone
ran 10-12% behind it (BERT-large 1:1 at 100 Mbit).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from galaxy.config import DP_ENGINES, MP_GRAD_REDUCE, SP_ATTENTIONS, ConfigError, Method, balanced_split
from galaxy.planner.cluster import ClusterProfile, device_subsets
from galaxy.planner.bounds import lower_bound, might_fit
from galaxy.planner.simulate import Prediction, predict
from galaxy.planner.workload import Layout, Splits, Workload, fsdp_reshards, fsdp_sharded, fsdp_syncs_once

logger = logging.getLogger(__name__)

EXACT_LIMIT = 200_000
SPLIT_MARGIN = 0.03
DEVICE_MARGIN = 0.03
CHUNK = 20_000  # candidates scored in one vectorised pass
METHODS = [(att, con, mlp) for att in (Method.TP, Method.SP, Method.NONE) for con in (Method.SP, Method.NONE)
           for mlp in (Method.TP, Method.SP, Method.NONE)]


def method_combinations(mp: int) -> list[tuple[Method, Method, Method]]:
    """The method combinations the search scores on ``mp`` ranks: with one, every block runs whole (none)."""
    return METHODS if mp > 1 else [(Method.NONE,) * 3]


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
    # the workload's (config keys of the same names), which search may vary
    dp_engine: str = "ddp"
    mp_grad_reduce: str = "after_backward"
    reshard_after_forward: str = "default"
    fsdp_grad_sync: str = "every_micro_batch"
    sp_attention: str = "allgather"

    @property
    def key(self) -> tuple:
        """What the plan runs: where, how split and laid out, on which engine and settings."""
        return (self.devices, self.methods, self.layout, self.heads, self.ffn, self.seq, self.dp_engine,
                self.mp_grad_reduce, self.sp_attention, self.reshard_after_forward, self.fsdp_grad_sync)

    @property
    def engine(self) -> str:
        """The dp engine as bench_train names its FSDP2 settings (``fsdp2-noreshard-onesync``)."""
        if self.dp_engine != "fsdp2":
            return self.dp_engine
        return "fsdp2" + ("-noreshard" if self.reshard_after_forward == "never" else "") \
            + ("-onesync" if self.fsdp_grad_sync == "last_micro_batch" else "")

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
        self.ulysses = att == Method.SP and work.sp_attention == "ulysses"
        group = 1 if self.ulysses else m.num_attention_heads // m.kv_heads  # Ulysses sends kv heads where read
        self.units = {"heads": (group, m.num_attention_heads // group),
                      "ffn": (ffn_unit, m.intermediate_size // ffn_unit),
                      "seq": (seq_unit, work.seq_length // seq_unit)}
        uses = []
        if att == Method.TP or self.ulysses:
            uses.append("heads")
        if mlp == Method.TP:
            uses.append("ffn")
        if Method.SP in methods:
            uses.append("seq")
        self.uses = tuple(uses) if self.mp > 1 else ()
        self._lower_bound: Optional[float] = None
        self._scored: dict[tuple, tuple[Prediction, np.ndarray]] = {}

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
        one = self._one_key(chosen)
        if one in self._scored:  # the start, the even split and the descent's end come back
            return self._scored[one]
        pred = predict(self.cluster, self.work, self.methods, self.splits(chosen), self.layout)
        over = (pred.memory_bytes - np.array([r.memory_bytes for r in self.cluster.ranks])).clip(min=0).sum(axis=1)
        key = np.where(pred.fits, pred.time_s, np.inf)
        if not pred.fits.any():  # nothing fits: least memory over the budgets, then time
            key = over * 1e6 + pred.time_s
        if one is not None:
            self._scored[one] = (pred, key)
        return pred, key

    def _one_key(self, chosen: dict[str, np.ndarray]) -> Optional[tuple]:
        """A single candidate's splits as a key (None for several)."""
        if any(len(a) != 1 for a in chosen.values()):
            return None
        return tuple((v, tuple(int(x) for x in chosen[v][0])) for v in sorted(chosen))

    def own_costs(self, var: str) -> np.ndarray:
        """Per-rank forward+backward seconds of the pieces that ``var`` sizes, by unit count."""
        unit, count = self.units[var]
        att, con, mlp = self.methods
        sp_att = (["att_proj.tokens"] + ([] if self.ulysses else ["att_core.tokens"])) if att == Method.SP else []
        pieces = {"heads": ["att_core.heads"] if self.ulysses else ["att_proj.heads", "att_core.heads"],
                  "ffn": ["mlp.ffn"],
                  "seq": sp_att + (["mlp.tokens"] if mlp == Method.SP else []) + (["con.tokens"] * 2 if con == Method.SP
                                                                                  else [])}[var]
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
        start_key, balanced_key = self.score(start)[1][0], self.score(balanced)[1][0]
        current = start if start_key <= balanced_key else balanced  # the even split may be the better start
        best_key = min(start_key, balanced_key)
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
                    base, eye = current[v][0], np.eye(self.mp, dtype=np.int64)
                    sizes = 2 ** np.arange(int(base.max()).bit_length())  # far moves first get near, then 1s refine
                    trial = np.array([base + size * (eye[j] - eye[i]) for size in sizes for i in range(self.mp)
                                      for j in range(self.mp) if i != j and base[i] > size])
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
                or (best.fits and not even.fits) \
                or (even.fits == best.fits and even.time_s > best.time_s * (1 + margin)):
            return best  # (an uneven split that does not fit never displaces an even one that does)
        even.lower_bound_s = best.time_s if best.exact else best.lower_bound_s
        return even

    def choice(self, chosen: dict[str, np.ndarray], pred: Prediction, exact: bool) -> Choice:
        """The Choice for one candidate (``chosen`` rows and ``pred`` of length 1)."""
        s = self.splits(chosen)
        time = float(pred.time_s[0])
        return Choice(self.methods, self.layout, tuple(int(x) for x in s.heads[0]), tuple(int(x) for x in s.ffn[0]),
                      tuple(int(x) for x in s.seq[0]), time, tuple(int(x) for x in pred.memory_bytes[0]),
                      bool(pred.fits[0]), exact, self.uses, time if exact else None,
                      dp_engine=self.work.dp_engine, mp_grad_reduce=self.work.mp_grad_reduce,
                      sp_attention=self.work.sp_attention if self.methods[0] == Method.SP and self.mp > 1
                      else "allgather",
                      **dict(zip(("reshard_after_forward", "fsdp_grad_sync"),
                                 fsdp_settings(self.work, self.layout, self.mp))))


RECOMPUTE = ("none", "selective", "mlp", "full")


def layouts(cluster: ClusterProfile, work: Workload) -> list[list[Layout]]:
    """Per dp x pp x mp of the world, its layouts in two tiers: first those worth running for speed
    (one micro-batch without a pipeline, pp or more with one; no recomputation), then the ones that
    only save memory (more micro-batches, down to one row each; selective, mlp or full recomputation),
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
           device_margin: float = DEVICE_MARGIN, prune: bool = True,
           dp_engines: Sequence[str] = (), mp_grad_reduces: Sequence[str] = (),
           sp_attentions: Sequence[str] = ()) -> list[Choice]:
    """The plans, best first (those within every memory budget before those that are not; the first
    on the fewest devices unless more win by more than ``device_margin``): one per set of devices
    (every subset of the cluster's ranks: on slow links fewer devices can be faster, one alone runs
    the plan 'none'), method combination, dp x pp and dp engine (``work``'s, and with dp > 1 each of
    ``dp_engines``; FSDP2 there with and without resharding after forward, and with its gradients
    reduce-scattered every micro-batch or once) and mp gradient reduction (``work``'s, and with mp > 1 each of
    ``mp_grad_reduces`` its dp engine runs with) and SP attention flavour (``work``'s, and for plans whose ATT
    is SP on more than one rank each of ``sp_attentions``; ring only without attention dropout, which it
    lacks), with its best micro-batch count and recomputation, its splits even unless uneven ones win by
    more than ``split_margin``.

    ``prune`` (the default) leaves out what cannot change the answer (``Pruner``): the same plans
    as ``prune=False``, which scores every layout of every group."""
    m = work.model
    for key, total, unit in (("ffn_unit", m.intermediate_size, ffn_unit), ("seq_unit", work.seq_length, seq_unit)):
        if unit < 1 or total % unit:
            raise ConfigError(f"--{key} {unit} must be a positive divisor of {total}")
    for key, margin in (("split_margin", split_margin), ("device_margin", device_margin)):
        if not 0 <= margin < 1:
            raise ConfigError(f"--{key} {margin} must be a fraction from 0 to below 1, e.g. 0.03")
    works = [work] + [w for e in dict.fromkeys(dp_engines) if e != work.dp_engine for w in engine_workloads(work, e)]
    for reduce in mp_grad_reduces:
        if reduce not in MP_GRAD_REDUCE:
            raise ConfigError(f"--mp_grad_reduces: '{reduce}' is not one of {', '.join(MP_GRAD_REDUCE)}")
    other_reduce = [replace(w, mp_grad_reduce=r) for r in dict.fromkeys(mp_grad_reduces) for w in works
                    if r != w.mp_grad_reduce and runs_with(w.dp_engine, r)]
    works += other_reduce
    other_reduce_ids = {id(w) for w in other_reduce}
    for flavour in sp_attentions:
        if flavour not in SP_ATTENTIONS:
            raise ConfigError(f"--sp_attentions: '{flavour}' is not one of {', '.join(SP_ATTENTIONS)}")
    other_flavour = [replace(w, sp_attention=f) for f in dict.fromkeys(sp_attentions) for w in works
                     if f != w.sp_attention and not (f == "ring" and m.attention_probs_dropout_prob > 0)]
    works += other_flavour
    other_flavour_ids = {id(w) for w in other_flavour}
    groups = []
    for devices in device_subsets(cluster.world):
        sub = cluster.restrict(devices)
        if sub is None:
            logger.info("devices %s skipped: the cluster file has no measurements for their groups", list(devices))
            continue
        for w in works:
            tiers = layouts(sub, w)
            for fast, frugal in zip(tiers[::2], tiers[1::2]):
                mp = sub.world // (fast[0].dp * fast[0].pp)
                if (w.dp_engine != work.dp_engine and fast[0].dp == 1) \
                        or ((id(w) in other_reduce_ids or id(w) in other_flavour_ids) and mp == 1):  # no such axis
                    continue
                for methods in method_combinations(mp):
                    if (id(w) not in other_reduce_ids or reduction_acts(methods, w.mp_grad_reduce)) \
                            and (id(w) not in other_flavour_ids or methods[0] == Method.SP):
                        groups.append(Group(len(groups), devices, sub, methods, fast, frugal, w))
    found = Pruner(ffn_unit, seq_unit, exact_limit, split_margin, top if prune else None).run(groups)
    if not found:
        raise ConfigError(f"no plan fits the world of {cluster.world} ranks: the model has too few heads, "
                          "FFN units or tokens for it")
    found.sort(key=lambda c: (not c.fits, c.time_s))
    first = fewest_devices_unless_beaten(found, device_margin)
    return [first] + [c for c in found if c is not first][:top - 1]


def reduction_acts(methods: tuple[Method, Method, Method], mp_grad_reduce: str) -> bool:
    """Whether ``mp_grad_reduce`` changes a run of ``methods`` from after_backward's: FSDP over mp shards
    the matrices of SP blocks (ATT, MLP); the other reductions act on PARTIAL weights, which an SP block
    of any kind makes (a row-parallel bias of a TP block, also PARTIAL, is left out: a vector)."""
    att, con, mlp = methods
    if mp_grad_reduce == "fsdp":
        return Method.SP in (att, mlp)
    return mp_grad_reduce != "after_backward" and Method.SP in methods


def runs_with(dp_engine: str, mp_grad_reduce: str) -> bool:
    """Whether the config takes this dp engine with this mp gradient reduction
    (``galaxy.config.checks._validate_fsdp``)."""
    return not ((dp_engine == "fsdp2" and mp_grad_reduce in ("overlap", "sharded"))
                or (dp_engine in ("zero1", "deepspeed") and mp_grad_reduce == "fsdp"))


def engine_workload(work: Workload, dp_engine: str) -> Workload:
    """``work`` under another dp engine, its ``mp_grad_reduce`` made one the engine runs with (FSDP2
    reduces inside FSDP: a config's sharded or overlap becomes after_backward, as the config requires)."""
    if dp_engine not in DP_ENGINES:
        raise ConfigError(f"--dp_engines: '{dp_engine}' is not one of {', '.join(DP_ENGINES)}")
    reduce = work.mp_grad_reduce if runs_with(dp_engine, work.mp_grad_reduce) else "after_backward"
    return replace(work, dp_engine=dp_engine, mp_grad_reduce=reduce)


def engine_workloads(work: Workload, dp_engine: str) -> list[Workload]:
    """``engine_workload``; for FSDP2 with each setting of ``reshard_after_forward`` (default, never) and
    ``fsdp_grad_sync`` (every micro-batch, last): the anchor recipe's FSDP2 keeps its weights gathered and
    reduce-scatters once, trading memory for traffic."""
    base = engine_workload(work, dp_engine)
    if dp_engine != "fsdp2":
        return [base]
    return [replace(base, reshard_after_forward=r, fsdp_grad_sync=g)
            for r in ("default", "never") for g in ("every_micro_batch", "last_micro_batch")]


def beats_setting(a: Choice, b: Choice) -> bool:
    """Whether ``a``, another FSDP2 setting of ``b``'s run, makes ``b`` pointless: no slower, holding no more
    (on a fast link keeping the weights gathered saves no time and costs their memory), ties to the first key."""
    return a.key[:-2] == b.key[:-2] and a.key != b.key and (a.fits or not b.fits) and a.time_s <= b.time_s \
        and max(a.memory_bytes) <= max(b.memory_bytes) \
        and (a.time_s, max(a.memory_bytes), a.key) < (b.time_s, max(b.memory_bytes), b.key)


def fsdp_settings(work: Workload, layout: Layout, mp: int = 1) -> tuple[str, str]:
    """``work``'s FSDP settings as they act on ``layout`` with ``mp`` ranks per group, the defaults where they
    change nothing (without FSDP over dp or mp; ``never`` is FSDP2's default with a pipeline; one
    micro-batch syncs once either way), so that two variants of one run are one plan."""
    fsdp = any(fsdp_sharded(work, layout.dp, mp))
    reshards = fsdp_reshards(work.reshard_after_forward, layout.pp)
    reshard = "default" if not fsdp or reshards == fsdp_reshards("default", layout.pp) else \
        ("always" if reshards else "never")
    sync = "last_micro_batch" if fsdp and fsdp_syncs_once(work.fsdp_grad_sync, layout.microbatches) \
        else "every_micro_batch"
    return reshard, sync


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


@dataclass
class Group:
    """One set of devices, method combination and dp x pp: the best of its layouts is one plan. Its
    layouts come in two tiers (``layouts``): the memory-saving ones are tried only when nothing in the
    first fits."""

    index: int  # in the order of the exhaustive search (ties between equal times keep it)
    devices: tuple[int, ...]
    cluster: ClusterProfile  # the profile of ``devices`` alone
    methods: tuple[Method, Method, Method]
    fast: list[Layout]
    frugal: list[Layout]
    work: Workload  # with the dp engine these layouts run under


class Pruner:
    """Scores the groups, leaving out a group or layout whose plan cannot be in the table nor chosen.

    A plan's time is at least its layout's ``lower_bound`` (over every split; one without
    recomputation bounds the same micro-batches with it too, whose events only add: the bound's
    stretches are anchored at syncs that both have). A plan of time T cannot be among the ``top``
    first nor be the best on its number of devices (from which the plan to run is picked) once ``top``
    fitting plans are faster than T (plans that do not fit come after those that fit) and so is a
    fitting plan on as many devices; so a group or layout whose bound is above that is left out. Groups go in the
    order of their bounds, so the fast plans set the bar early. Inside a group a layout whose
    bound is above the group's best fitting plan so far cannot replace it. A first-tier layout is
    left out only where its even split fits (so the tier fits, and the second tier is not tried,
    as without pruning); otherwise it runs, since whether its tier fits decides which layouts
    compete. A layout that cannot fit (``might_fit``) is left out: its plan displaces none that fits,
    and plans that do not fit are shown only where fewer than ``top`` fit, which is known at the
    end; then the groups that left one out are scored again without leaving any out. ``top`` None:
    every layout of every group is scored."""

    def __init__(self, ffn_unit: int, seq_unit: int, exact_limit: int, split_margin: float, top: Optional[int]):
        self.ffn_unit, self.seq_unit = ffn_unit, seq_unit
        self.exact_limit, self.split_margin, self.top = exact_limit, split_margin, top
        self.bounds: dict[tuple[int, int], float] = {}
        self.fitting: list[float] = []  # the fitting plans' times so far, ascending
        self.best_at: dict[int, float] = {}  # the best fitting plan's time so far, per device count
        self.searched = 0
        # per group index and layout: its split search (the splits it scored, its bound) and its plan, which the
        # bounds, the even-split check and the misfits' second pass ask for again
        self.searches: dict[tuple[int, Layout], SplitSearch] = {}
        self.plans: dict[tuple[int, Layout], Optional[Choice]] = {}

    def splits(self, group: Group, layout: Layout) -> SplitSearch:
        key = (group.index, layout)
        if key not in self.searches:
            self.searches[key] = SplitSearch(group.cluster, group.work, group.methods, layout, self.ffn_unit,
                                             self.seq_unit, self.exact_limit)
        return self.searches[key]

    def bound(self, group: Group, layout: Layout) -> float:
        """The lower bound of ``layout``'s micro-batches without recomputation (so of every recomputation)."""
        key = (group.index, layout.microbatches)
        if key not in self.bounds:
            search = self.splits(group, replace(layout, recompute="none"))
            self.bounds[key] = search.lower_bound() if search.feasible() else math.inf
        return self.bounds[key]

    def hopeless(self, bound: float, devices: int) -> bool:
        """Whether a plan on ``devices`` devices taking at least ``bound`` seconds is neither among the
        ``top`` first nor the best on its number of devices (which decides the plan to run, even where
        it is not run itself: it holds back a plan on more devices that does not beat it by the margin)."""
        return self.top is not None and len(self.fitting) >= self.top and self.fitting[self.top - 1] < bound \
            and self.best_at.get(devices, math.inf) < bound

    def run(self, groups: list[Group]) -> list[Choice]:
        """Each group's plan (those left out aside), in the groups' order."""
        order = groups
        if self.top is not None:
            group_bound = {g.index: min(self.bound(g, layout) for layout in g.fast + g.frugal) for g in groups}
            order = sorted(groups, key=lambda g: (group_bound[g.index], g.index))
        plans, misfits = {}, []
        for g in order:
            if self.top is not None and self.hopeless(group_bound[g.index], len(g.devices)):
                continue
            plan, misfit_unseen = self.best(g, skip_misfits=self.top is not None)
            if misfit_unseen and (plan is None or not plan.fits):
                misfits.append(g)
            if plan is None:
                continue
            self.admit(replace(plan, devices=g.devices), g.index, plans)
        if self.top is not None and len(self.fitting) < self.top:  # plans that do not fit are shown after all
            for g in misfits:
                plan, _ = self.best(g, skip_misfits=False)
                if plan is not None:
                    self.admit(replace(plan, devices=g.devices), g.index, plans)
        logger.info("%d of %d groups, %d split searches", len(plans), len(groups), self.searched)
        return [plans[i] for i in sorted(plans)]

    def admit(self, plan: Choice, index: int, plans: dict[int, Choice]) -> bool:
        """Record ``plan`` (group ``index``) unless it is one already recorded (an FSDP2 setting that changes
        nothing on its layout) or another setting of its run beats it (``beats_setting``); drop those it beats.
        A fitting plan's time joins the bar (``fitting``, ``best_at``); a dropped one's leaves ``fitting``: it set
        no bar that its better one does not."""
        if any(a.key == plan.key or beats_setting(a, plan) for a in plans.values()):
            return False
        for i, a in list(plans.items()):
            if beats_setting(plan, a):
                del plans[i]
                if a.fits:
                    self.fitting.remove(a.time_s)
        plans[index] = plan
        if plan.fits:
            bisect.insort(self.fitting, plan.time_s)
            devices = len(plan.devices)
            self.best_at[devices] = min(self.best_at.get(devices, math.inf), plan.time_s)
        return True

    def best(self, group: Group, skip_misfits: bool) -> tuple[Optional[Choice], bool]:
        """The group's best plan: the first tier's, or where none of it fits, the best of both (ties
        to the layout listed first); None where it is left out. Layouts go in the order of their
        bounds, so a good plan early leaves out the others. ``skip_misfits``: layouts that cannot fit
        are left out (which the second value says), so a plan that does not fit may not be the group's."""
        best, fits_unseen, misfit_unseen = None, False, False
        for t, tier in enumerate((group.fast, group.frugal)):
            order = range(len(tier)) if self.top is None else \
                sorted(range(len(tier)), key=lambda k: (self.bound(group, tier[k]), k))
            for k in order:
                layout = tier[k]
                if self.top is not None:
                    bound = self.bound(group, layout)
                    if best is not None and best[0].fits and bound > best[0].time_s:
                        continue
                    if self.hopeless(bound, len(group.devices)):
                        if t == 1:
                            continue
                        if self.even_fits(group, layout):  # the tier fits, and this layout's plan is hopeless
                            fits_unseen = True
                            continue
                    if skip_misfits and self.splits(group, layout).feasible() and not self.might_fit(group, layout):
                        misfit_unseen = True  # a plan that does not fit displaces none that does
                        continue
                choice = self.choose(group, layout)
                if choice is not None and (best is None or (not choice.fits, choice.time_s, (t, k))
                                           < (not best[0].fits, best[0].time_s, best[1])):
                    best = (choice, (t, k))
            if best is not None and best[0].fits:
                break
            if fits_unseen:  # the group's best is a first-tier plan left out as hopeless
                return None, misfit_unseen
            if best is None and not misfit_unseen:  # nothing in the tier has a split at all
                break
        return (None if best is None else best[0]), misfit_unseen

    def might_fit(self, group: Group, layout: Layout) -> bool:
        search = self.splits(group, layout)
        return might_fit(group.cluster, group.work, group.methods, layout, search.units, search.uses)

    def even_fits(self, group: Group, layout: Layout) -> bool:
        search = self.splits(group, layout)
        return search.feasible() and bool(search.score(search.balanced())[0].fits[0])

    def choose(self, group: Group, layout: Layout) -> Optional[Choice]:
        key = (group.index, layout)
        if key not in self.plans:
            search = self.splits(group, layout)
            self.searched += 1
            choice = search.run()
            self.plans[key] = None if choice is None else search.even_unless_beaten(choice, self.split_margin)
        return self.plans[key]
