"""Time the real ATT, CON and MLP blocks of a model (``galaxy.models``) on one rank, forward and
backward, with the bytes they save for backward, at the candidate shard sizes (heads, FFN columns,
tokens): the compute half of a cluster profile (``galaxy.planner.profile``)."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from galaxy.config import Method, ModelConfig, Plan
from galaxy.core.attention import attention
from galaxy.core.context import ParallelContext
from galaxy.core.layers import Dropout
from galaxy.models import family
from galaxy.planner.cluster import Curve, Piece

logger = logging.getLogger(__name__)

FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
RETIME_TOLERANCE = 0.10  # a sample this far off its neighbours' line is timed again
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


def grid(total: int, unit: int = 1, most: int = 16) -> list[int]:
    """Candidate shard sizes: multiples of ``unit`` up to ``total``, all of them when few, else
    the fractions of ``FRACTIONS`` rounded to the unit."""
    count = total // unit
    if count <= most:
        return [unit * k for k in range(1, count + 1)]
    return sorted({max(unit, round(total * f / unit) * unit) for f in FRACTIONS})


class BlockBench:
    """The model's own block modules on one rank (its family's probes, ``GalaxyModel.*_probe``),
    built with a one-rank plan whose TP shard is the size under test (the rank holds ``heads``
    heads / ``ffn`` columns as rank 0 of a wider split)."""

    def __init__(self, m: ModelConfig, rows: int, seq: int, device: torch.device, dtype: str):
        self.m, self.rows, self.seq, self.device = m, rows, seq, device
        self.dtype = TORCH_DTYPES[dtype]
        self.ctx = ParallelContext.serial(device)
        self.family = family(m.model_type)

    def plan(self, heads: int, ffn: int) -> Plan:
        m = self.m
        H, F_ = m.num_attention_heads, m.intermediate_size
        att = Method.TP if heads < H else Method.NONE
        mlp = Method.TP if ffn < F_ else Method.NONE
        return Plan(att, Method.NONE, mlp, (heads, H - heads) if heads < H else (H,),
                    (ffn, F_ - ffn) if ffn < F_ else (F_,), (self.seq,))

    def _ready(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(self.device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if name.endswith("weight") else 0.0)
        return module.to(self.dtype if self.dtype == torch.float64 else torch.float32)

    def _x(self, tokens: int, width: Optional[int] = None) -> torch.Tensor:
        return torch.randn(self.rows, tokens, width or self.m.hidden_size, device=self.device,
                           requires_grad=True)

    def att_proj(self, heads: int, tokens: int):
        plan = self.plan(heads, self.m.intermediate_size)
        return [self._x(tokens)], self._ready(self.family.att_proj_probe(self.m, plan, self.ctx, self.seq))

    def att_core(self, heads: int, q_tokens: int, kv_tokens: int):
        m = self.m
        plan = self.plan(heads, m.intermediate_size)
        d, kv_heads = m.head_dim, heads // (m.num_attention_heads // m.kv_heads)
        out = self._ready(self.family.att_out_probe(m, plan, self.ctx))
        dropout = Dropout(m.attention_probs_dropout_prob, self.ctx.generator(sharded=True))
        q = torch.randn(self.rows, heads, q_tokens, d, device=self.device, requires_grad=True)
        k, v = (torch.randn(self.rows, kv_heads, kv_tokens, d, device=self.device, requires_grad=True)
                for _ in range(2))

        def run(q, k, v):
            o = attention(q, k, v, causal=self.family.causal, q_offset=kv_tokens - q_tokens, dropout=dropout)
            return out(o.transpose(1, 2).reshape(self.rows, q_tokens, heads * d))
        return [q, k, v], run

    def mlp(self, ffn: int, tokens: int):
        plan = self.plan(self.m.num_attention_heads, ffn)
        return [self._x(tokens)], self._ready(self.family.mlp_probe(self.m, plan, self.ctx))

    def con(self, tokens: int):
        plan = self.plan(self.m.num_attention_heads, self.m.intermediate_size)
        return [self._x(tokens), self._x(tokens)], self._ready(self.family.con_probe(self.m, plan, self.ctx))

    def head(self, tokens: int):
        """Embeddings, output head and the loss of ``tokens`` tokens."""
        m = self.m
        ids = torch.randint(0, m.vocab_size, (self.rows, tokens), device=self.device)
        plan = self.plan(m.num_attention_heads, m.intermediate_size)
        head = self._ready(self.family.head_probe(m, plan, self.ctx))
        return [], lambda: F.cross_entropy(head(ids).float().reshape(-1, m.vocab_size), ids.reshape(-1))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timers read the host clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceTimer:
    """Seconds of consecutive parts of a GPU's work, by CUDA events, with the host ahead of the GPU:
    a spin kernel holds the stream while the host queues the parts, so the events time the kernels,
    not their launches, as in a training step whose host runs ahead of a busy GPU. On the host
    clock, with a synchronize around each part, every piece and collective carried a 0.2-0.8 ms
    floor per call on an H200 (docs/benchmarks-log.md)."""

    MAX_LEAD_S = 0.05  # work that synchronizes inside (a .item()) never gets ahead: its host time is its cost

    def __init__(self, device: torch.device):
        self.device, self.lead_s = device, 2e-3
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # loads the spin kernel
            start.record()
            torch.cuda._sleep(10**7)
            end.record()
            end.synchronize()
            self.cycles_per_s = 1e7 / (start.elapsed_time(end) / 1e3)

    def time(self, parts: Sequence[Callable[[], object]], retry: bool = True) -> tuple[float, ...]:
        """Seconds of each of ``parts``, run in order on the current stream (the device idle before).
        Where the GPU woke before the host had queued every part, the lead grows and, with ``retry``,
        the parts run again (not for collectives: every member must run them equally often)."""
        with torch.cuda.device(self.device):
            while True:
                events = [torch.cuda.Event(enable_timing=True) for _ in range(len(parts) + 1)]
                torch.cuda._sleep(int(self.cycles_per_s * self.lead_s))
                queued = time.perf_counter()
                events[0].record()
                for part, event in zip(parts, events[1:]):
                    part()
                    event.record()
                queued = time.perf_counter() - queued
                events[-1].synchronize()
                took = tuple(a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:]))
                if queued < 0.8 * self.lead_s or self.lead_s >= self.MAX_LEAD_S:
                    return took
                self.lead_s = min(2 * queued, self.MAX_LEAD_S)
                if not retry:
                    return took


def saved_bytes(fn: Callable, inputs: list) -> int:
    """Bytes of the tensors autograd saves for backward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


class PieceRun:
    """One piece at one size, ready to run forward and backward again and again."""

    def __init__(self, bench: BlockBench, make: Callable, timer: Optional[DeviceTimer] = None):
        self.device, self.timer = bench.device, timer
        self.inputs, self.fn = make()
        self.autocast = (torch.autocast(bench.device.type, dtype=bench.dtype)
                         if bench.dtype in (torch.bfloat16, torch.float16)
                         else torch.autocast(bench.device.type, enabled=False))
        self.grads = None

    def forward(self) -> list[torch.Tensor]:
        with self.autocast:
            out = self.fn(*self.inputs)
        return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]

    def once(self) -> tuple[float, float, float]:
        """Seconds of a training forward, its backward, and an inference forward (no autograd)."""
        if self.timer is not None:
            return self.timed_on_device()
        synchronize(self.device)
        t0 = time.perf_counter()
        outs = self.forward()
        synchronize(self.device)
        t1 = time.perf_counter()
        self.grads = self.grads or [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, self.grads)
        synchronize(self.device)
        t2 = time.perf_counter()
        for x in self.inputs:
            x.grad = None
        with torch.no_grad():
            self.forward()
        synchronize(self.device)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def timed_on_device(self) -> tuple[float, float, float]:
        outs: list[torch.Tensor] = []

        def forward():
            outs[:] = self.forward()

        def backward():
            self.grads = self.grads or [torch.randn_like(o) for o in outs]
            torch.autograd.backward(outs, self.grads)
            outs.clear()

        def infer():
            for x in self.inputs:
                x.grad = None
            with torch.no_grad():
                self.forward()
        return self.timer.time([forward, backward, infer])

    def saved(self) -> int:
        with self.autocast:
            return saved_bytes(self.fn, self.inputs)


def windowed(once: Callable[[], tuple[float, ...]], window_s: float) -> tuple[float, ...]:
    """Mean seconds of each part of ``once()``, run again and again for at least ``window_s``: the
    wall time of the whole loop per run, shared out in proportion to the parts' fastest timings. A
    CPU quota (cgroup CFS: full speed until the period's quota is spent, then stopped until the
    next period) makes one short run time the full speed; a run of a plan sees the average, and so
    does a window of a few periods. A stop lands in one part or another at random, so the parts'
    shares come from their fastest (unstopped) runs. ``window_s`` 0: one run."""
    fastest = None
    count = 0
    start = time.perf_counter()
    while True:
        t = once()
        fastest = t if fastest is None else tuple(min(a, b) for a, b in zip(fastest, t))
        count += 1
        if time.perf_counter() - start >= window_s:
            break
    if window_s <= 0:
        return fastest
    per_run, total = (time.perf_counter() - start) / count, sum(fastest)
    return tuple(per_run * p / total if total > 0 else per_run / len(fastest) for p in fastest)


def off_the_line(sizes: Sequence[int], values: Sequence[float], tolerance: float) -> list[int]:
    """Indices of ``values`` more than ``tolerance`` (relative) off the line through their two
    neighbours (at an end, the two nearest): where a burst of load may have hit a sample. A real
    bend of the curve is flagged too; timed again it comes back the same."""
    n = len(sizes)
    if n < 3:
        return []
    out = []
    for i in range(n):
        a, b = (i - 1, i + 1) if 0 < i < n - 1 else ((1, 2) if i == 0 else (n - 3, n - 2))
        line = values[a] + (values[b] - values[a]) * (sizes[i] - sizes[a]) / (sizes[b] - sizes[a])
        if line <= 0 or abs(values[i] / line - 1) > tolerance:
            out.append(i)
    return out


def time_pieces(bench: BlockBench, makes: list[Callable], sizes: Sequence[int], reps: int,
                barrier: Callable[[], None], agree: Callable[[list[int]], list[int]] = sorted,
                window_s: float = 0.0, timer: Optional[DeviceTimer] = None) -> list[tuple[float, float, float, int]]:
    """Median forward, backward and inference-forward seconds, and saved bytes, of one piece at several ``sizes``,
    each sample the mean over a window (``windowed``). The sizes take turns within each repetition,
    so a burst of load from elsewhere disturbs one sample of many sizes rather than every sample of
    one (the median then drops it). A burst longer than that leaves a size off the line through its
    neighbours (``off_the_line``); those sizes, on any rank (``agree``: the union over the ranks, so
    all keep timing together), are timed again, the new samples replacing the old (a median of
    both would keep half of a burst that hit every sample). A piece at full size is what the
    calibration holds the serial model to: one burst there scaled every other size of that rank
    (BERT-large 1:1: two equal ranks 11% apart at half the sequence)."""
    runs = [PieceRun(bench, make, timer) for make in makes]
    samples: list[list[tuple[float, float, float]]] = [[] for _ in runs]

    def rounds(which: Sequence[int], warm: bool) -> None:
        for i in range(reps + warm):  # a first round warms up
            timed = i >= warm
            for k in which:
                barrier()
                t = windowed(runs[k].once, window_s if timed else 0.0)
                if timed:
                    samples[k].append(t)

    def medians() -> list[tuple[float, ...]]:
        return [tuple(statistics.median(t[q] for t in taken) for q in range(3)) for taken in samples]

    rounds(range(len(runs)), warm=True)
    now = medians()
    suspect = {i for q in range(3) for i in off_the_line(sizes, [m[q] for m in now], RETIME_TOLERANCE)}
    again = agree(sorted(suspect))
    if again:
        logger.info("timing %d of %d sizes again: off the line through their neighbours", len(again), len(runs))
        for k in again:
            samples[k] = []
        rounds(again, warm=False)
        now = medians()
    return [(*m, run.saved()) for m, run in zip(now, runs)]


def measure_blocks(m: ModelConfig, rows: int, seq: int, device: torch.device, dtype: str, reps: int,
                   barrier: Callable[[], None], ffn_unit: int = 1, window_s: float = 0.0,
                   agree: Callable[[list[int]], list[int]] = sorted,
                   timer: Optional[DeviceTimer] = None) -> dict[str, Piece]:
    """Every piece at its sizes; ``timer``: on a GPU, by its events (``DeviceTimer``), else by the host clock."""
    bench = BlockBench(m, rows, seq, device, dtype)
    H, F_ = m.num_attention_heads, m.intermediate_size
    heads = grid(H, H // m.kv_heads)
    tokens = grid(seq)
    ffns = grid(F_, ffn_unit)
    plan = {
        "att_proj.heads": (heads, lambda n: bench.att_proj(n, seq)),
        "att_proj.tokens": (tokens, lambda n: bench.att_proj(H, n)),
        "att_core.heads": (heads, lambda n: bench.att_core(n, seq, seq)),
        "att_core.tokens": (tokens, lambda n: bench.att_core(H, n, seq)),
        "mlp.ffn": (ffns, lambda n: bench.mlp(n, seq)),
        "mlp.tokens": (tokens, lambda n: bench.mlp(F_, n)),
        "con.tokens": (tokens, bench.con),
        "head.tokens": (tokens, bench.head),
    }
    pieces = {}
    for name, (sizes, make) in plan.items():
        rows_ = time_pieces(bench, [lambda n=n: make(n) for n in sizes], sizes, reps, barrier, agree, window_s, timer)
        tsizes = tuple(sizes)
        pieces[name] = Piece(*(Curve(tsizes, tuple(float(r[k]) for r in rows_)) for k in (0, 1, 3)),
                             infer=Curve(tsizes, tuple(r[2] for r in rows_)))
        logger.info("measured %s at %d sizes", name, len(sizes))
    return pieces
