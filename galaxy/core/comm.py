"""Collectives of one process group, with uneven splits along any dimension.

Gloo and NCCL both want equal pieces for the single-tensor collectives, so uneven pieces are
padded to the largest one and trimmed afterwards; even splits take the direct path. Every call
can be observed (op, group, bytes, time, phase) by the profiler; with no observer nothing is timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


PHASES = ("fwd", "bwd", "other")


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen on this rank."""

    op: str  # all_reduce | all_gather | reduce_scatter | send | recv | broadcast | ...
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


@dataclass
class Communicator:
    """One process group (or none, for a single rank) and the collectives on it."""

    name: str
    rank: int = 0
    size: int = 1
    group: Optional[dist.ProcessGroup] = None
    observers: list[CommObserver] = field(default_factory=list)
    bytes_sent: int = 0  # running total of collective payload bytes; cheap, always on

    # -- bookkeeping

    def _timed(self, op: str, nbytes: int, phase: str, fn: Callable[[], None], device: torch.device) -> None:
        self.bytes_sent += nbytes
        if not self.observers:
            fn()
            return
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        record = CommRecord(op, self.name, nbytes, time.perf_counter() - start, phase)
        for observe in self.observers:
            observe(record)

    # -- collectives (each returns a new tensor; inputs are never modified)

    def all_reduce(self, x: torch.Tensor, phase: str = "other") -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.contiguous().clone()
        self._timed("all_reduce", out.numel() * out.element_size(), phase,
                    lambda: dist.all_reduce(out, group=self.group), out.device)
        return out

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
        out = torch.empty((piece * self.size,) + local.shape[1:], dtype=x.dtype, device=x.device)
        nbytes = sum(sizes) * local[0].numel() * x.element_size()
        self._timed("all_gather", nbytes, phase, lambda: _all_gather_single(out, local, group=self.group), x.device)
        if any(s != piece for s in sizes):
            out = torch.cat([out[i * piece: i * piece + s] for i, s in enumerate(sizes)])
        return out.movedim(0, dim).contiguous()

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
        out = torch.empty((piece,) + full.shape[1:], dtype=x.dtype, device=x.device)
        nbytes = x.numel() * x.element_size()
        self._timed("reduce_scatter", nbytes, phase,
                    lambda: _reduce_scatter_single(out, full, group=self.group), x.device)
        return out[: sizes[self.rank]].movedim(0, dim).contiguous()

    def split(self, x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
        """This rank's slices of a replicated tensor (no communication)."""
        if self.size == 1:
            return x
        offset = sum(sizes[: self.rank])
        return x.narrow(dim, offset, sizes[self.rank]).contiguous()

    def broadcast(self, x: torch.Tensor, src: int, phase: str = "other") -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.contiguous().clone()
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._timed("broadcast", out.numel() * out.element_size(), phase,
                    lambda: dist.broadcast(out, global_src, group=self.group), out.device)
        return out
