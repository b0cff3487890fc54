"""Collectives of one process group, with uneven splits along any dimension.

Gloo and NCCL both want equal pieces for the single-tensor collectives, so uneven pieces are
padded to the largest one and trimmed afterwards; even splits take the direct path. Every call
can be observed (op, group, bytes, time, phase) by the profiler; with no observer nothing is timed.

The collectives are torch's functional ones (``torch.distributed._functional_collectives``): they
run eagerly as they are, and ``torch.compile`` traces them into its graph without a break (model
key ``compile``). Inside a compiled graph the Python around them runs only while tracing, so the
byte count is a tensor the graph itself advances each time it runs; observers, which time each
call with a device synchronize, cannot run there (``galaxy.core.compile`` refuses them). The
point-to-point ``start_exchange`` (ring attention's K/V blocks) is c10d's ``batch_isend_irecv`` and
runs eagerly only. On a Gloo group the all-gather is an all-to-all (``_gathered`` says why).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_functional_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_functional_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def _gathered(x: torch.Tensor, group: dist.ProcessGroup, size: int, by_exchange: bool) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0 (``size`` ranks). ``by_exchange`` (Gloo groups): an all-to-all
    that sends ``x`` to every rank, the same bytes. Gloo runs a functional all-gather as an ALLGATHER_COALESCED
    work, and its worker threads write a finished work's name into one std::string of the group without a lock:
    a 19-character name puts that string on the heap, and two workers finishing together corrupt it (the
    quickstart's rare heap corruption; docs/design.md, "Gloo's work names"). ALLTOALL fits inline."""
    if not by_exchange:
        return funcol.wait_tensor(_functional_all_gather(x, 0, group))
    n = x.numel()
    sent = x.reshape(1, n).expand(size, n).reshape(-1)  # x once per destination rank
    out = funcol.wait_tensor(funcol.all_to_all_single(sent, [n] * size, [n] * size, group))
    return out.view(size * x.shape[0], *x.shape[1:])


def _scattered(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's block of dim 0 of ``x`` summed over ranks."""
    return funcol.wait_tensor(_functional_reduce_scatter(x, "sum", 0, group))


def _exchanged(flat: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of a flat buffer: ``send_sizes[j]`` elements go to rank j, ``recv_sizes[i]`` come from rank i."""
    return funcol.wait_tensor(funcol.all_to_all_single(flat, recv_sizes, send_sizes, group))


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out contiguously: ``t`` itself where it already is, not ``t.contiguous()``. Under torch
    2.11's dynamo an autograd.Function whose forward returns a no-op ``.contiguous()`` of a tensor it made
    gets an all-zero gradient (2.13 is right); the transitions return these results, and with one sequence
    per micro-batch the sequence dim's ``movedim`` and ``narrow`` are contiguous already (docs/benchmarks-log.md,
    "Rows per micro-batch on 2 GPUs")."""
    return t if t.is_contiguous() else t.contiguous()


PHASES = ("fwd", "bwd", "other")


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen on this rank."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv | send | recv | broadcast | ...
    group: str  # name of the process group ("mp", "dp", "pp", ...)
    nbytes: int  # bytes this rank contributes or receives, unpadded
    seconds: float  # wall time of the call (synchronised by the caller)
    phase: str  # "fwd" | "bwd" ("other" accepted for work outside forward/backward)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"CommRecord.phase must be one of {PHASES}, got {self.phase!r}")
        if self.nbytes < 0 or self.seconds < 0:
            raise ValueError(f"CommRecord needs nbytes >= 0 and seconds >= 0, got {self}")


CommObserver = Callable[[CommRecord], None]


class PendingExchange:
    """A point-to-point exchange in flight (``Communicator.start_exchange``): ``wait()`` returns the
    received tensor. The sent tensor is held until then, so its memory is not reused while it travels."""

    def __init__(self, works: list, sent: torch.Tensor, received: torch.Tensor):
        self._works, self._sent, self.received = works, sent, received

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()  # NCCL: the compute stream waits for the transfer, not the CPU
        self._works, self._sent = [], None
        return self.received


@dataclass
class Communicator:
    """One process group (or none, for a single rank) and the collectives on it."""

    name: str
    rank: int = 0
    size: int = 1
    group: Optional[dist.ProcessGroup] = None
    observers: list[CommObserver] = field(default_factory=list)
    # Running total of collective payload bytes (``bytes_sent``); cheap, always on. CPU tensors,
    # not an int, so that a compiled graph counts its collectives each time it runs; backward
    # collectives count into their own tensor, because AOTAutograd keeps a backward graph's
    # mutation of an input only when the forward graph does not mutate that input too.
    _sent: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64), repr=False,
                                compare=False)
    _sent_in_backward: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64),
                                            repr=False, compare=False)

    # Gloo groups all-gather by an all-to-all (``_gathered``); set from the group's backend.
    _gather_by_exchange: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._gather_by_exchange = self.size > 1 and dist.is_initialized() and \
            dist.get_backend(self.process_group) == dist.Backend.GLOO

    @property
    def bytes_sent(self) -> int:
        return int(self._sent) + int(self._sent_in_backward)

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self._sent.fill_(value)
        self._sent_in_backward.zero_()

    # -- bookkeeping

    def timed(self, op: str, nbytes: int, phase: str, fn: Callable[[], Optional[torch.Tensor]],
               device: torch.device) -> Optional[torch.Tensor]:
        """Run the collective ``fn`` (which waits for its result), counting its bytes and, for
        observers, timing it; returns what ``fn`` returns."""
        (self._sent_in_backward if phase == "bwd" else self._sent).add_(nbytes)
        if not self.observers:
            return fn()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        record = CommRecord(op, self.name, nbytes, time.perf_counter() - start, phase)
        for observe in self.observers:
            observe(record)
        return out

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    # -- collectives (each returns a new tensor; inputs are never modified)

    def all_reduce(self, x: torch.Tensor, phase: str = "other") -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        return self.timed("all_reduce", x.numel() * x.element_size(), phase,
                           lambda: _summed(x, self.process_group), x.device)

    def all_gather(self, x: torch.Tensor, dim: int, sizes: Sequence[int], phase: str = "other") -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``; rank i contributes ``sizes[i]`` slices."""
        if self.size == 1:
            return x
        assert x.shape[dim] == sizes[self.rank], (x.shape, dim, sizes, self.rank)
        piece = max(sizes)
        local = x.movedim(dim, 0)
        if local.shape[0] < piece:
            local = F.pad(local, (0, 0) * (local.dim() - 1) + (0, piece - local.shape[0]))
        local = local.contiguous()
        nbytes = sum(sizes) * local[0].numel() * x.element_size()
        gathered = lambda: _gathered(local, self.process_group, self.size, self._gather_by_exchange)  # noqa: E731
        out = self.timed("all_gather", nbytes, phase, gathered, x.device)
        if any(s != piece for s in sizes):
            out = torch.cat([out[i * piece: i * piece + s] for i, s in enumerate(sizes)])
        return _contiguous(out.movedim(0, dim))

    def reduce_scatter(self, x: torch.Tensor, dim: int, sizes: Sequence[int], phase: str = "other") -> torch.Tensor:
        """Sum ``x`` over ranks and keep this rank's ``sizes[rank]`` slices along ``dim``."""
        if self.size == 1:
            return x
        assert x.shape[dim] == sum(sizes), (x.shape, dim, sizes)
        piece = max(sizes)
        full = x.movedim(dim, 0)
        if any(s != piece for s in sizes):
            pad = (0, 0) * (full.dim() - 1)
            full = torch.cat([F.pad(c, pad + (0, piece - c.shape[0])) for c in full.split(list(sizes))])
        full = full.contiguous()
        out = self.timed("reduce_scatter", x.numel() * x.element_size(), phase,
                          lambda: _scattered(full, self.process_group), x.device)
        return _contiguous(out[: sizes[self.rank]].movedim(0, dim))

    def all_to_all(self, pieces: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]],
                   phase: str = "other") -> list[torch.Tensor]:
        """Send ``pieces[j]`` to rank j and return what each rank i sent here, shaped ``recv_shapes[i]``
        (any shapes and sizes, empty ones included: one ``all_to_all_single`` of a flat buffer with split
        sizes). Records the bytes of every piece this rank sends, its own included, as an all-gather
        counts its whole output."""
        assert len(pieces) == len(recv_shapes) == self.size, (len(pieces), len(recv_shapes), self.size)
        if self.size == 1:
            return [pieces[0].reshape(recv_shapes[0])]
        send_sizes = [p.numel() for p in pieces]
        recv_sizes = [math.prod(shape) for shape in recv_shapes]
        flat = torch.cat([p.reshape(-1) for p in pieces])
        out = self.timed("all_to_all", flat.numel() * flat.element_size(), phase,
                          lambda: _exchanged(flat, send_sizes, recv_sizes, self.process_group), flat.device)
        return [piece.view(shape) for piece, shape in zip(out.split(recv_sizes), recv_shapes)]

    def start_exchange(self, send: torch.Tensor, recv: torch.Tensor, dst: int, src: int, phase: str = "other",
                       tag: int = 0) -> PendingExchange:
        """Send ``send`` to rank ``dst`` and receive into ``recv`` from rank ``src`` (ranks of this group),
        asynchronously: the caller computes while the tensors travel and ``wait()``s before it reads
        ``recv``. Records the bytes sent; an observed exchange is timed, so it completes inside its window
        (no overlap while a profiler watches). ``tag`` keeps two exchanges in flight between the same
        ranks apart (Gloo matches by tag; NCCL keeps posting order)."""
        if self.size == 1:
            recv.copy_(send)
            return PendingExchange([], send, recv)
        send = send.contiguous()
        ops = [dist.P2POp(dist.isend, send, self.global_rank(dst), self.group, tag),
               dist.P2POp(dist.irecv, recv, self.global_rank(src), self.group, tag)]
        works: list = []

        def run() -> None:
            started = dist.batch_isend_irecv(ops)
            if self.observers:
                for work in started:
                    work.wait()
            else:
                works.extend(started)

        self.timed("send_recv", send.numel() * send.element_size(), phase, run, send.device)
        return PendingExchange(works, send, recv)

    def global_rank(self, rank: int) -> int:
        """The world rank of this group's ``rank``."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def split(self, x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
        """This rank's slices of a replicated tensor (no communication)."""
        if self.size == 1:
            return x
        offset = sum(sizes[: self.rank])
        return _contiguous(x.narrow(dim, offset, sizes[self.rank]))

    def broadcast(self, x: torch.Tensor, src: int, phase: str = "other") -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.contiguous().clone()
        global_src = self.global_rank(src)

        def run() -> torch.Tensor:  # in place, as c10d broadcasts (not a traced block collective)
            dist.broadcast(out, global_src, group=self.group)
            return out

        return self.timed("broadcast", out.numel() * out.element_size(), phase, run, out.device)
