"""The cluster profile (``cluster.json``): what the cost model knows about each rank and group.

    {"version": 1, "world": N, "backend": "gloo", "device": "cpu",
     "model": {ModelConfig fields}, "rows": [1, 16], "seq_length": S, "dtype": "float32",
     "ranks": [{"rank": 0, "host": "...", "memory_bytes": M,
                "pieces": {"16": {"att_proj.heads": {"sizes": [...], "fwd_s": [...], "bwd_s": [...],
                                                     "infer_s": [...], "act_bytes": [...]}, ...}, "1": {...}},
                "optimizer": {"alpha_s": a, "s_per_param": b, "samples": [[params, seconds], ...]},
                "step_overhead_s": o, "forward_overhead_s": f, "step_compute_scale": c,
                "forward_compute_scale": d, "activation_scale": a, "sustained_scale": z}],
     "groups": [{"ranks": [0, 1], "ops": {"all_reduce": {"alpha_s": a, "beta_s_per_byte": b,
                                                         "samples": [[bytes, seconds], ...]}, ...},
                 "early_leave": {"all_reduce": {...}, ...}}]}

A piece is one block's compute measured on one rank at each of the ``rows`` batch sizes, as a
function of one size (``PIECES``); the other sizes are the model's full ones, or for
``att_core.tokens`` the local queries against all ``seq_length`` keys (ATT.sp). Between and beyond
the measured batch sizes a piece is linear in rows (so a fixed per-call overhead is kept, not
scaled); with one batch size it is proportional. Collective bytes are the full tensor's bytes
(``galaxy.core.comm`` pads uneven pieces to the largest one; the cost model charges that).
A group's ``ops`` (``OPS``) are the seconds from the last member's arrival at a collective until it leaves,
``early_leave`` until the members that were waiting for it leave: not the same over Gloo's TCP
transport, where an all-gather lets the waiting members go ~0.4-0.5x its time before the last one
(its peers' pieces reach the last member only after its own have left; docs/benchmarks-log.md). Files
without ``early_leave`` (older ones) have every member leave together. ``all_to_all`` is timed by the whole
input a rank sends (its own piece included, as ``galaxy.core.comm`` records it), ``send_recv`` by the bytes each
member sends to the next while it receives from the one before (a ring shift, as ring attention's steps). Files
from before these were measured derive them from the group's all-gather: an all-to-all of B bytes as an all-gather
of B (each moves (N-1)/N of it per rank), a ring shift of B as an all-gather of N/(N-1) x B (whose ring moves
(N-1)/N of its output through every link).
The overheads are what the fastest of a few real serial training steps / batch-1 forwards of the
model took on the rank beyond the cost model's prediction from its pieces; every prediction adds
them. Where the real model took less than its pieces (blocks timed one by one run a little slower than inside the
model), the compute scales (at most 1; absent: 1) say by how much, and every piece's time on that
rank is scaled by them. Where a real serial step's peak memory (a GPU's allocator reports it) grew by fewer
activations per layer than the pieces saved (its peak against the same step's with one layer less; a compiled
layer keeps less for backward than its pieces run eagerly), ``activation_scale`` (at most 1; absent: 1)
scales every piece's saved bytes in training.
``layer_compute_scale`` (absent: 1): on a GPU, what one layer of a real serial training step took (the step
against the same step with one layer less, both timed) over what its layer pieces predict, after the compute
scale; every piece but the head's is multiplied by it in training. A 2-layer calibration step fitted as a whole
leaves the layers' share wrong: on an H200 the pieces under-predicted a 7B layer by 7% and over-predicted the
head, so 32 layers ran 6% slower than a plan predicted (docs/benchmarks-log.md).
``host_link_bytes_per_s`` (absent: ``DEFAULT_HOST_LINK_BYTES_PER_S``): on a GPU, the rank's pinned host copies'
bytes per second, the slower direction (what an offloading layer's copies run at); elsewhere the default.
``host_memory_bytes`` (absent: no limit): the pinned host memory the rank may offload to.
``sustained_scale`` (at least 1; absent: 1): a serial training step's time after some seconds of steps
back to back over its time in the short runs the pieces and the calibration were timed in; a GPU held at
its power limit by a training run clocks lower than in a burst (an H200 at 700 W: 1,550-1,600 MHz
against 1,980), and every piece's time in training is multiplied by it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from galaxy.config import ConfigError, ModelConfig
from galaxy.core.context import rank_of

VERSION = 1
DEFAULT_HOST_LINK_BYTES_PER_S = 20e9  # a rank's host link where unmeasured (a CPU: configured, not measured)
# piece name -> the size it varies (the others are full)
PIECES = {
    "att_proj.heads": "query heads; q/k/v projections (and RoPE) on all tokens",
    "att_proj.tokens": "tokens; q/k/v projections of all heads",
    "att_core.heads": "query heads; attention core + output projection, all tokens",
    "att_core.tokens": "local query tokens against all keys; core + output projection, all heads",
    "mlp.ffn": "intermediate columns; the MLP on all tokens",
    "mlp.tokens": "tokens; the whole MLP",
    "con.tokens": "tokens; one CON block (residual add, norm, dropout)",
    "head.tokens": "tokens; embeddings + output head + loss",
}
EDGE_PIECES = frozenset({"head.tokens"})  # the model's ends, once a step: the rest run once per layer
WHOLE_SIZES = 2**17  # piece sizes below this are looked up in a table of every whole size (``whole_sizes``)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# Measured since the SP attention flavours (sp_attention: ulysses's all-to-alls, ring's point-to-point
# exchanges); a file from before holds the first three, and these are derived from its all-gather.
LATER_OPS = ("all_to_all", "send_recv")


def layout_groups(world: int) -> list[tuple[int, ...]]:
    """Every mp, dp, pp and adjacent-stage group of every factorisation world = dp x pp x mp."""
    found: list[tuple[int, ...]] = []
    for dp in range(1, world + 1):
        for pp in range(1, world // dp + 1):
            if world % (dp * pp):
                continue
            mp = world // (dp * pp)
            at = lambda d, p, m: rank_of(d, p, m, pp, mp)  # noqa: E731
            families = [[at(d, p, m) for m in range(mp)] for d in range(dp) for p in range(pp)]
            families += [[at(d, p, m) for d in range(dp)] for p in range(pp) for m in range(mp)]
            families += [[at(d, p, m) for p in range(pp)] for d in range(dp) for m in range(mp)]
            families += [[at(d, p, m), at(d, p + 1, m)] for d in range(dp) for p in range(pp - 1) for m in range(mp)]
            for g in families:
                if len(g) > 1 and tuple(g) not in found:
                    found.append(tuple(g))
    return found


def device_subsets(world: int) -> list[tuple[int, ...]]:
    """Every non-empty set of a cluster's ranks a plan can run on, the whole cluster first."""
    return [d for k in range(world, 0, -1) for d in itertools.combinations(range(world), k)]


def candidate_groups(world: int) -> list[tuple[int, ...]]:
    """Every group a plan on any subset of the ``world`` ranks can use (``layout_groups`` of each
    subset, in the cluster's rank numbers)."""
    found: list[tuple[int, ...]] = []
    for devices in device_subsets(world):
        for g in layout_groups(len(devices)):
            mapped = tuple(devices[i] for i in g)
            if mapped not in found:
                found.append(mapped)
    return found


def isotonic(values: Sequence[float]) -> np.ndarray:
    """Non-decreasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return np.concatenate([np.full(int(n), m) for m, n in blocks])


@dataclass(frozen=True)
class Curve:
    """A measured quantity at increasing ``sizes``: piecewise linear between them, extended
    linearly beyond (never below zero). Timings are noisy, so the values are first replaced by
    their isotonic (non-decreasing least-squares) fit: the split search relies on monotone
    per-rank times, and a running maximum would let one slow outlier lift every larger size."""

    sizes: tuple[int, ...]
    values: tuple[float, ...]

    @functools.cached_property
    def _fit(self) -> tuple[np.ndarray, np.ndarray]:
        """(sizes, isotonic values): fitted once, a search evaluates the curve millions of times."""
        return np.asarray(self.sizes, dtype=float), isotonic(self.values)

    def knots(self) -> list[float]:
        """The sizes where the curve may bend: the measured ones, and where its extension below the
        smallest crosses zero (it is clamped there). Between two knots it is linear."""
        xs, ys = self._fit
        out = [float(x) for x in xs]
        if len(xs) > 1:
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            if slope > 0 and ys[0] < slope * xs[0]:
                out.append(float(xs[0] - ys[0] / slope))
        return out

    def __call__(self, x) -> np.ndarray:
        xs, ys = self._fit
        x = np.asarray(x, dtype=float)
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        out = np.interp(x, xs, ys)
        lo, hi = x < xs[0], x > xs[-1]
        out = np.where(lo, ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]), out)
        out = np.where(hi, ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), out)
        return np.maximum(np.where(x <= 0, 0.0, out), 0.0)


@dataclass(frozen=True)
class Piece:
    fwd: Curve
    bwd: Curve
    act: Curve  # bytes saved for backward
    infer: Optional[Curve] = None  # the forward without autograd (a request's); None: as ``fwd``


@dataclass(frozen=True)
class AlphaBeta:
    """A collective's seconds by message bytes. With two or more measured ``samples`` of (bytes,
    seconds): their isotonic fit, linear between the measured sizes, beyond the largest along its
    last segment, below the smallest towards the fitted latency ``alpha_s`` at zero bytes. A real
    link is not one line (a token bucket lets a burst through at line rate, the transport switches
    algorithms by size), and the straight fit ``alpha_s + beta_s_per_byte * bytes`` missed the
    measured times by up to 40% in between. Without samples: the line."""

    alpha_s: float
    beta_s_per_byte: float
    samples: tuple[tuple[float, float], ...] = ()

    @functools.cached_property
    def _fit(self) -> Optional[tuple[np.ndarray, np.ndarray, float, float]]:
        """(sizes with 0 in front, their isotonic seconds with the latency at 0 in front, the slope beyond
        the largest size); None: the line. Fitted once: a search evaluates each link thousands of times."""
        if len(self.samples) < 2:
            return None
        pairs = sorted(self.samples)
        xs = np.array([p[0] for p in pairs])
        ys = isotonic([p[1] for p in pairs])
        if np.ptp(xs) == 0:
            return None
        first = min(self.alpha_s, ys[0])
        k = len(xs) - 1
        while k > 0 and xs[k - 1] == xs[k]:
            k -= 1
        slope = (ys[-1] - ys[k - 1]) / (xs[-1] - xs[k - 1]) if k > 0 else self.beta_s_per_byte
        return np.concatenate([[0.0], xs]), np.concatenate([[first], ys]), slope

    def __call__(self, nbytes) -> np.ndarray:
        x = np.asarray(nbytes, dtype=float)
        fit = self._fit
        if fit is None:
            return self.alpha_s + self.beta_s_per_byte * x
        xs, ys, slope = fit
        out = np.interp(x, xs, ys)
        return np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * slope, out)

    def scaled_bytes(self, factor: float) -> "AlphaBeta":
        """The same link for messages ``factor`` times as large: ``t'(n) = t(factor * n)``."""
        return AlphaBeta(self.alpha_s, self.beta_s_per_byte * factor,
                         tuple((b / factor, t) for b, t in self.samples))

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> "AlphaBeta":
        """Least squares on relative errors (timing noise is proportional to the time, and plain
        least squares would let the largest messages drown the latency), both terms non-negative:
        a negative one is dropped and the other refitted."""
        x = np.array([s[0] for s in samples], dtype=float)
        y = np.array([s[1] for s in samples], dtype=float)
        if len(x) >= 2 and np.ptp(x) > 0:
            beta, alpha = np.polyfit(x, y, 1, w=1 / np.maximum(y, 1e-12))
        else:
            alpha, beta = 0.0, float(y.mean() / max(x.mean(), 1.0))
        if alpha < 0:
            alpha, beta = 0.0, float(np.median(y / np.maximum(x, 1.0)))
        if beta < 0:
            alpha, beta = float(y.mean()), 0.0
        return cls(float(alpha), float(beta), tuple((float(a), float(b)) for a, b in samples))


@dataclass(frozen=True)
class RankProfile:
    rank: int
    host: str
    memory_bytes: int
    pieces: dict[int, dict[str, Piece]]  # by rows
    optimizer: AlphaBeta  # seconds = alpha + s_per_param * local trainable parameters
    # what a real serial step / batch-1 forward took beyond the pieces' prediction (loop, data, Python)
    step_overhead_s: float = 0.0
    forward_overhead_s: float = 0.0
    # real serial compute over the pieces' prediction where it was less (training, inference)
    step_compute_scale: float = 1.0
    forward_compute_scale: float = 1.0
    # the activations a layer of a real serial training step held over its pieces' saved bytes, where less (at
    # most 1: a compiled layer saves less than its pieces run eagerly); 1 where the device reports no peak (CPU)
    activation_scale: float = 1.0
    # a serial training step's time after seconds of back-to-back steps over the calibration's (at least 1: a GPU
    # at its power limit clocks lower than in the bursts the pieces were timed in); 1 where unmeasured (CPU)
    sustained_scale: float = 1.0
    # a real layer's training time (a serial step against the same with one layer less) over its pieces' after
    # the compute scale; scales every piece but the head's in training; 1 where unmeasured (CPU: too noisy)
    layer_compute_scale: float = 1.0
    host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S  # pinned copies to/from the host (GPU: measured)
    host_memory_bytes: Optional[int] = None  # pinned host memory the rank may offload to; None: no limit
    # the serial runs those came from (seconds; the peak bytes, None where unmeasured; empty in older files)
    serial_steps_s: tuple[float, ...] = ()
    serial_forwards_s: tuple[float, ...] = ()
    serial_peak_bytes: Optional[int] = None
    shallower_peak_bytes: Optional[int] = None  # the same step's with one layer less
    shallower_steps_s: tuple[float, ...] = ()  # that step's times, where they calibrate layer_compute_scale
    # piece values (scaled) at every whole size up to some length, by the pieces, rows and scales they come from
    # (a search asks for the same sizes millions of times); shared by the copies ``replace`` makes
    tables: dict = field(default_factory=dict, compare=False, repr=False)

    def piece(self, name: str, rows: int, sizes, inference: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward s, backward s, saved bytes) of piece ``name`` at ``rows`` rows and ``sizes``;
        ``inference``: the forward without autograd where it was measured."""
        sizes = np.asarray(sizes)
        if sizes.dtype.kind in "iu" and sizes.size > 0:
            most = int(sizes.max())
            if most < WHOLE_SIZES and sizes.min() >= 0:  # looked up in a table of every whole size
                return tuple(t[sizes] for t in self.whole_sizes(name, rows, most, inference))
        used, measured, scales = self._source(name, rows, inference)
        return self._scaled(self._piece(used, measured, rows, sizes, inference), scales)

    def whole_sizes(self, name: str, rows: int, most: int, inference: bool = False) -> tuple[np.ndarray, ...]:
        """``piece`` at every whole size from 0 to at least ``most`` (below ``WHOLE_SIZES``): index them by
        sizes (a search asks for the same sizes millions of times). Keyed by what decides the table (the pieces and
        the scales ``_source`` reads), so that a hit costs one lookup."""
        key = ("whole", name, rows, inference, id(self.pieces), self.forward_compute_scale, self.step_compute_scale,
               self.sustained_scale, self.layer_compute_scale, self.activation_scale)
        entry = self.tables.get(key)
        if entry is None or len(entry[1][0]) <= most:
            used, measured, scales = self._source(name, rows, inference)
            whole = np.arange(1 << most.bit_length())
            entry = (self.pieces, self._scaled(self._piece(used, measured, rows, whole, inference), scales))
            self.tables[key] = entry  # holds the pieces: their id stays theirs while cached
        return entry[1]

    def _source(self, name: str, rows: int, inference: bool) -> tuple[tuple[Piece, ...], list[int], tuple]:
        """The measured pieces ``name`` at ``rows`` comes from (the measured rows around it), those rows,
        and the scales of its (forward, backward, saved bytes)."""
        measured = sorted(self.pieces)
        k = min(max(bisect.bisect_left(measured, rows), 1), len(measured) - 1)  # the measured rows around ``rows``
        used = tuple(self.pieces[r][name] for r in measured[k - 1:k + 1])
        if inference:
            return used, measured, (self.forward_compute_scale, self.forward_compute_scale, None)
        layer = 1.0 if name in EDGE_PIECES else self.layer_compute_scale
        scale = self.step_compute_scale * self.sustained_scale * layer
        return used, measured, (scale, scale, self.activation_scale)

    @staticmethod
    def _scaled(values: tuple[np.ndarray, ...], scales: tuple[Optional[float], ...]) -> tuple[np.ndarray, ...]:
        return tuple(v if s is None else v * s for v, s in zip(values, scales))

    def knots(self, names: Sequence[str], memory: bool = False) -> frozenset[float]:
        """Every knot (``Curve.knots``) of the time curves (saved bytes for ``memory``) of pieces ``names``."""
        key = ("knots", id(self.pieces), tuple(names), memory)
        if key not in self.tables:
            found = set()
            for by_name in self.pieces.values():
                for name in names:
                    p = by_name[name]
                    curves = (p.act,) if memory else (p.fwd, p.bwd) + ((p.infer,) if p.infer is not None else ())
                    for curve in curves:
                        found.update(curve.knots())
            self.tables[key] = (self.pieces, frozenset(found))  # holds the pieces: their id stays theirs
        return self.tables[key][1]

    def _piece(self, used: tuple[Piece, ...], measured: list[int], rows: int, sizes,
               inference: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unscaled values of ``used`` (one measured batch size: proportional in rows; else the two
        around ``rows``: linear between them and beyond)."""
        def curves(p: Piece) -> tuple[Curve, Curve, Curve]:
            return (p.infer if inference and p.infer is not None else p.fwd), p.bwd, p.act

        if len(used) == 1:
            scale = rows / measured[0]
            return tuple(c(sizes) * scale for c in curves(used[0]))
        k = min(max(int(np.searchsorted(measured, rows)), 1), len(measured) - 1)
        lo, hi = measured[k - 1], measured[k]
        w = (rows - lo) / (hi - lo)
        return tuple(np.maximum(fa(sizes) + w * (fb(sizes) - fa(sizes)), 0.0)
                     for fa, fb in zip(curves(used[0]), curves(used[1])))


@dataclass(frozen=True)
class ClusterProfile:
    world: int
    backend: str
    device: str
    model: ModelConfig
    rows: tuple[int, ...]
    seq_length: int
    dtype: str
    ranks: tuple[RankProfile, ...]
    groups: dict[tuple[int, ...], dict[str, AlphaBeta]]  # until the last member to arrive leaves
    early_leave: dict[tuple[int, ...], dict[str, AlphaBeta]] = field(default_factory=dict)  # the others

    def collective(self, ranks: Sequence[int], op: str) -> AlphaBeta:
        """Seconds from the last member's arrival until it leaves (so every member has left)."""
        key = tuple(ranks)
        if key not in self.groups:
            raise ConfigError(f"cluster file has no measurements for group {list(key)}; profile again with "
                              f"--world {self.world} (it measures every group a plan can use)")
        return self.groups[key][op]

    def waiting_leave(self, ranks: Sequence[int], op: str) -> AlphaBeta:
        """Seconds from the last member's arrival until the members that waited for it leave; where
        the file has none, as ``collective``."""
        key = tuple(ranks)
        return self.early_leave[key][op] if key in self.early_leave else self.collective(ranks, op)

    def restrict(self, devices: Sequence[int]) -> "ClusterProfile | None":
        """The profile of ``devices`` alone (ascending), renumbered 0..k-1; None when the file lacks
        a group a plan on them can use (profiled before subsets were measured)."""
        groups, early = {}, {}
        for g in layout_groups(len(devices)):
            key = tuple(devices[i] for i in g)
            if key not in self.groups:
                return None
            groups[g] = self.groups[key]
            if key in self.early_leave:
                early[g] = self.early_leave[key]
        ranks = tuple(replace(self.ranks[d], rank=i) for i, d in enumerate(devices))
        return replace(self, world=len(devices), ranks=ranks, groups=groups, early_leave=early)

    def p2p(self, a: int, b: int) -> AlphaBeta:
        """Point-to-point a <-> b, as an all-gather of twice the bytes on the pair (one each way)."""
        return self.collective(sorted((a, b)), "all_gather").scaled_bytes(2.0)

    def to_dict(self) -> dict[str, Any]:
        def fits_dict(ops: dict[str, AlphaBeta]) -> dict:
            return {op: {"alpha_s": ab.alpha_s, "beta_s_per_byte": ab.beta_s_per_byte,
                         "samples": [list(s) for s in ab.samples]} for op, ab in ops.items()}

        def curve_dict(p: Piece) -> dict:
            return {"sizes": list(p.fwd.sizes), "fwd_s": list(p.fwd.values), "bwd_s": list(p.bwd.values),
                    "act_bytes": list(p.act.values), **({"infer_s": list(p.infer.values)} if p.infer else {})}

        return {
            "version": VERSION, "world": self.world, "backend": self.backend, "device": self.device,
            "model": {k: v for k, v in vars(self.model).items()}, "rows": list(self.rows),
            "seq_length": self.seq_length, "dtype": self.dtype,
            "ranks": [{"rank": r.rank, "host": r.host, "memory_bytes": r.memory_bytes,
                       "pieces": {str(rows): {n: curve_dict(p) for n, p in by_name.items()}
                                  for rows, by_name in r.pieces.items()},
                       "optimizer": {"alpha_s": r.optimizer.alpha_s, "s_per_param": r.optimizer.beta_s_per_byte,
                                     "samples": [list(s) for s in r.optimizer.samples]},
                       "step_overhead_s": r.step_overhead_s, "forward_overhead_s": r.forward_overhead_s,
                       "step_compute_scale": r.step_compute_scale, "forward_compute_scale": r.forward_compute_scale,
                       "activation_scale": r.activation_scale, "sustained_scale": r.sustained_scale,
                       "serial_steps_s": list(r.serial_steps_s), "serial_forwards_s": list(r.serial_forwards_s),
                       "layer_compute_scale": r.layer_compute_scale, "host_link_bytes_per_s": r.host_link_bytes_per_s,
                       "host_memory_bytes": r.host_memory_bytes,
                       "serial_peak_bytes": r.serial_peak_bytes, "shallower_peak_bytes": r.shallower_peak_bytes,
                       "shallower_steps_s": list(r.shallower_steps_s)}
                      for r in self.ranks],
            "groups": [{"ranks": list(g), "ops": fits_dict(ops),
                        **({"early_leave": fits_dict(self.early_leave[g])} if g in self.early_leave else {})}
                       for g, ops in self.groups.items()],
        }

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


# ----------------------------------------------------------------------------- reading, with checks


class _Reader:
    """Typed access to the JSON tree; every failure names the key path and the file."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"cluster file '{self.source}': key '{key}' {problem}; profile the cluster again "
                           "(plan_galaxy.py profile) or fix that entry")

    def get(self, obj: Any, key: str, path: str, kind, positive: bool = False):
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"{path}{key}", "is missing")
        value = obj[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise self.fail(f"{path}{key}", f"must be {getattr(kind, '__name__', kind)}, got {value!r}")
        if positive and value <= 0:
            raise self.fail(f"{path}{key}", f"must be positive, got {value!r}")
        if kind is float and value < 0:
            raise self.fail(f"{path}{key}", f"must not be negative, got {value!r}")
        return float(value) if kind is float else value

    def numbers(self, obj: Any, key: str, path: str, length: int | None = None, increasing: bool = False):
        values = self.get(obj, key, path, list)
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                 and v >= 0 for v in values):
            raise self.fail(f"{path}{key}", "must be a non-empty list of non-negative numbers")
        if length is not None and len(values) != length:
            raise self.fail(f"{path}{key}", f"has {len(values)} entries but 'sizes' has {length}")
        if increasing and any(b <= a for a, b in zip(values, values[1:])):
            raise self.fail(f"{path}{key}", f"must be strictly increasing, got {values}")
        return tuple(values)

    def samples(self, obj: Any, path: str) -> tuple[tuple[float, float], ...]:
        raw = self.get(obj, "samples", path, list)
        if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(v, (int, float)) for v in s) for s in raw):
            raise self.fail(f"{path}samples", "must be a list of [size, seconds] pairs")
        return tuple((float(a), float(b)) for a, b in raw)

    def fits(self, group: Any, key: str, path: str, size: int) -> dict[str, AlphaBeta]:
        """One AlphaBeta per collective op under ``group[key]`` (a group of ``size`` ranks); ``LATER_OPS`` that a
        file from before them lacks are derived from its all-gather (the module docstring says how)."""
        ops_raw, ops = self.get(group, key, path, dict), {}
        for op in OPS:
            entry = ops_raw.get(op)
            if entry is None and op in LATER_OPS:
                continue
            if entry is None:
                raise self.fail(f"{path}{key}.{op}", "is missing")
            p = f"{path}{key}.{op}."
            ops[op] = AlphaBeta(self.get(entry, "alpha_s", p, float), self.get(entry, "beta_s_per_byte", p, float),
                                self.samples(entry, p))
        ops.setdefault("all_to_all", ops["all_gather"])
        ops.setdefault("send_recv", ops["all_gather"].scaled_bytes(size / (size - 1)))
        return ops


def cluster_from_dict(raw: Any, source: str = "<dict>") -> ClusterProfile:
    from galaxy.config import GalaxyConfig

    r = _Reader(source)
    if not isinstance(raw, dict):
        raise r.fail("(top level)", "must be a JSON object")
    version = r.get(raw, "version", "", int)
    if version != VERSION:
        raise r.fail("version", f"is {version} but this planner reads version {VERSION}")
    world = r.get(raw, "world", "", int, positive=True)
    rows = r.numbers(raw, "rows", "", increasing=True)
    if not all(isinstance(v, int) and v > 0 for v in rows):
        raise r.fail("rows", f"must list positive batch sizes, got {list(rows)}")
    seq = r.get(raw, "seq_length", "", int, positive=True)
    model_raw = r.get(raw, "model", "", dict)
    try:
        model = GalaxyConfig.from_dict({"model": model_raw, "train": {"seq_length": seq}}).model
    except ConfigError as e:
        raise r.fail("model", f"is not a valid model section ({e})") from None
    ranks_raw = r.get(raw, "ranks", "", list)
    if len(ranks_raw) != world:
        raise r.fail("ranks", f"has {len(ranks_raw)} entries but world is {world}")
    ranks = []
    for i, rank_raw in enumerate(ranks_raw):
        path = f"ranks[{i}]."
        if r.get(rank_raw, "rank", path, int) != i:
            raise r.fail(f"{path}rank", f"must be {i} (ranks are listed in order)")
        by_rows = r.get(rank_raw, "pieces", path, dict)
        pieces = {}
        for n in rows:
            pieces_raw = r.get(by_rows, str(n), f"{path}pieces.", dict)
            pieces[n] = {}
            for name in PIECES:
                p = f"{path}pieces.{n}.{name}."
                entry = pieces_raw.get(name)
                if entry is None:
                    raise r.fail(f"{path}pieces.{n}.{name}", "is missing")
                sizes = r.numbers(entry, "sizes", p, increasing=True)
                curves = [Curve(sizes, r.numbers(entry, k, p, len(sizes))) for k in ("fwd_s", "bwd_s", "act_bytes")]
                infer = Curve(sizes, r.numbers(entry, "infer_s", p, len(sizes))) if "infer_s" in entry else None
                pieces[n][name] = Piece(*curves, infer=infer)
            unknown = sorted(set(pieces_raw) - set(PIECES))
            if unknown:
                raise r.fail(f"{path}pieces.{n}.{unknown[0]}", f"is not a known piece (known: {', '.join(PIECES)})")
        opt = r.get(rank_raw, "optimizer", path, dict)
        optimizer = AlphaBeta(r.get(opt, "alpha_s", f"{path}optimizer.", float),
                              r.get(opt, "s_per_param", f"{path}optimizer.", float),
                              r.samples(opt, f"{path}optimizer."))
        scales = {}
        for key in ("step_compute_scale", "forward_compute_scale", "activation_scale"):
            scales[key] = r.get(rank_raw, key, path, float, positive=True) if key in rank_raw else 1.0  # older: 1
            if scales[key] > 1:
                raise r.fail(f"{path}{key}", f"must be at most 1 (a calibration scales down only: a longer real step "
                             f"is an overhead), got {scales[key]}")
        scales["sustained_scale"] = r.get(rank_raw, "sustained_scale", path, float, positive=True) \
            if "sustained_scale" in rank_raw else 1.0
        if scales["sustained_scale"] < 1:
            raise r.fail(f"{path}sustained_scale", f"must be at least 1 (a sustained step is no faster than a burst), "
                         f"got {scales['sustained_scale']}")
        scales["layer_compute_scale"] = r.get(rank_raw, "layer_compute_scale", path, float, positive=True) \
            if "layer_compute_scale" in rank_raw else 1.0  # older files: 1
        scales["host_link_bytes_per_s"] = r.get(rank_raw, "host_link_bytes_per_s", path, float, positive=True) \
            if "host_link_bytes_per_s" in rank_raw else DEFAULT_HOST_LINK_BYTES_PER_S  # older files, CPUs
        if rank_raw.get("host_memory_bytes") is not None:
            scales["host_memory_bytes"] = r.get(rank_raw, "host_memory_bytes", path, int, positive=True)
        serial = {key: r.numbers(rank_raw, key, path) if rank_raw.get(key, []) != [] else ()
                  for key in ("serial_steps_s", "serial_forwards_s", "shallower_steps_s")}  # older files: none
        for key in ("serial_peak_bytes", "shallower_peak_bytes"):
            if rank_raw.get(key) is not None:
                serial[key] = r.get(rank_raw, key, path, int, positive=True)
        ranks.append(RankProfile(i, str(rank_raw.get("host", "")),
                                 r.get(rank_raw, "memory_bytes", path, int, positive=True), pieces, optimizer,
                                 r.get(rank_raw, "step_overhead_s", path, float),
                                 r.get(rank_raw, "forward_overhead_s", path, float), **scales, **serial))
    groups, early = {}, {}
    for j, g in enumerate(r.get(raw, "groups", "", list)):
        path = f"groups[{j}]."
        members = r.get(g, "ranks", path, list)
        if len(members) < 2 or not all(isinstance(m, int) and 0 <= m < world for m in members) \
                or len(set(members)) != len(members):
            raise r.fail(f"{path}ranks", f"must list at least two distinct ranks of 0..{world - 1}, got {members}")
        groups[tuple(members)] = r.fits(g, "ops", path, len(members))
        if "early_leave" in g:  # older files: every member leaves together
            early[tuple(members)] = r.fits(g, "early_leave", path, len(members))
    return ClusterProfile(world, str(raw.get("backend", "")), str(raw.get("device", "")), model,
                          tuple(int(v) for v in rows), seq, str(raw.get("dtype", "float32")), tuple(ranks),
                          groups, early)


def load_cluster(path: str) -> ClusterProfile:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"cluster file '{path}' does not exist; write it with plan_galaxy.py profile") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"cluster file '{path}' is not valid JSON (line {e.lineno}: {e.msg})") from None
    return cluster_from_dict(raw, path)
