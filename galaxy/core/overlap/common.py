"""What the overlapped TP edges share (CoC in ``coc``, CCLoRA in ``cclora``, async TP in ``async_tp``):
async collectives launched through the ``Communicator``'s bookkeeping and waited for where their result
is consumed, the sequence-major layout the fused functions compute in, and autocast's casts applied by
hand around autograd functions that run with autocast off."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from galaxy.core.comm import Communicator, all_gather_single, reduce_scatter_single

__all__ = ["InFlight", "launch", "start_all_gather", "start_reduce_scatter", "start_all_reduce", "finish_into",
           "seq_major", "batch_major", "autocast_dtype", "cast_as_autocast", "apply_as_autocast"]


# ----------------------------------------------------------------------------- layout


def seq_major(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, f]`` -> contiguous ``[s, b, f]`` (a free view when b == 1)."""
    return x.transpose(0, 1).contiguous()


def batch_major(y: torch.Tensor) -> torch.Tensor:
    """``[s, b, f]`` -> contiguous ``[b, s, f]`` (a free view when b == 1)."""
    return y.transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------- async collectives


class InFlight:
    """A launched collective and the tensor its result lands in."""

    def __init__(self, work: Optional[dist.Work], result: torch.Tensor, keep: tuple = ()):
        self.work, self.result, self._keep = work, result, keep  # keep: buffers the collective reads

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()  # NCCL: the compute stream waits, not the CPU
            self.work, self._keep = None, ()
        return self.result


def launch(comm: Communicator, op: str, nbytes: int, phase: str, device: torch.device,
            start: Callable[[], dist.Work]) -> Optional[dist.Work]:
    """Start an async collective through the Communicator's bookkeeping (bytes, observers)."""
    works = []

    def run() -> None:
        work = start()
        if comm.observers:
            work.wait()  # an observed collective is timed, so it must finish inside the window
        else:
            works.append(work)

    comm.timed(op, nbytes, phase, run, device)
    return works[0] if works else None


def row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def start_all_gather(comm: Communicator, local: torch.Tensor, sizes: Sequence[int], phase: str) -> InFlight:
    """All-gather rank r's ``sizes[r]`` rows; the result is ``[world, max(sizes), ...]``, rank r's
    rows first in its slot (the rest is padding)."""
    width = max(sizes)
    send = local
    if local.shape[0] != width:  # uneven pieces: pad to the common width
        send = local.new_zeros((width,) + tuple(local.shape[1:]))
        send[: local.shape[0]].copy_(local)
    recv = local.new_empty((comm.size * width,) + tuple(local.shape[1:]))
    work = launch(comm, "all_gather", sum(sizes) * row_bytes(local), phase, local.device,
                   lambda: all_gather_single(recv, send, group=comm.group, async_op=True))
    return InFlight(work, recv.view((comm.size, width) + tuple(local.shape[1:])), (send,))


def start_reduce_scatter(comm: Communicator, send: torch.Tensor, sizes: Sequence[int], dest: torch.Tensor,
                          phase: str) -> InFlight:
    """Reduce-scatter ``send`` (``[world * width, ...]``, rank r's rows in slot r) into ``dest``
    (this rank's ``sizes[rank]`` rows): directly when no padding is involved, else via a buffer."""
    width = max(sizes)
    out = dest if dest.shape[0] == width else send.new_empty((width,) + tuple(send.shape[1:]))
    work = launch(comm, "reduce_scatter", sum(sizes) * row_bytes(send), phase, send.device,
                   lambda: reduce_scatter_single(out, send, group=comm.group, async_op=True))
    return InFlight(work, out, (send,))


def finish_into(dest: torch.Tensor, flight: InFlight) -> None:
    out = flight.wait()
    if out is not dest:
        dest.copy_(out[: dest.shape[0]])


def start_all_reduce(comm: Communicator, t: torch.Tensor, phase: str) -> InFlight:
    """All-reduce a contiguous block in place."""
    work = launch(comm, "all_reduce", t.numel() * t.element_size(), phase, t.device,
                   lambda: dist.all_reduce(t, group=comm.group, async_op=True))
    return InFlight(work, t)


# ----------------------------------------------------------------------------- autocast


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def cast_as_autocast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """What autocast does to a linear's operands: floating tensors below fp64 go to ``dtype``."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def apply_as_autocast(fn: type[torch.autograd.Function], x: torch.Tensor, *args):
    """Apply ``fn`` with its operands cast as autocast would, autocast off inside (it does not
    handle the ``out=`` matmuls, and the backward needs the forward's dtypes)."""
    dtype = autocast_dtype(x)
    args = [cast_as_autocast(a, dtype) if isinstance(a, torch.Tensor) else a for a in args]
    guard = torch.autocast(x.device.type, enabled=False) if dtype is not None else nullcontext()
    with guard:
        return fn.apply(cast_as_autocast(x, dtype), *args)
