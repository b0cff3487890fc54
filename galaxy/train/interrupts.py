"""Stopping a training run between steps: on SIGINT (Ctrl-C) or SIGTERM, and never writing once the
launcher that started this rank is gone.

While ``train`` runs with an ``Interrupts``, SIGINT and SIGTERM only note the request: a KeyboardInterrupt
raised mid-step would leave the other ranks inside a collective ("Connection closed by peer") and no
checkpoint. After each step every rank asks the others (``agreed``, one small all-reduce), so all stop
after the same step; the checkpoint schedule saves it, and ``train`` raises ``TrainingInterrupted`` on
every rank. A second SIGINT (Ctrl-C pressed again) raises KeyboardInterrupt at once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

from galaxy.train.checkpoint.lock import parent_of

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Every rank stopped after ``step`` on a signal. ``checkpoint``: the checkpoint that holds that step;
    None when there is none, and ``why_not`` says why."""

    def __init__(self, step: int, checkpoint: Optional[str], why_not: Optional[str] = None):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint, self.why_not = step, checkpoint, why_not


class LauncherGone(RuntimeError):
    """The process that started this rank has died: the rank writes nothing more."""


class Interrupts:
    """Signals caught while training runs (a context manager: the handlers are installed on entry, from
    the main thread only, and the previous ones restored on exit), and the launcher this rank must not
    outlive (``launcher_pid``: this rank's parent, or its parent's parent when the launcher started it from a
    forkserver; None when it has none to watch)."""

    def __init__(self, launcher_pid: Optional[int] = None):
        self.launcher_pid = launcher_pid
        self._parent = os.getppid()  # where /proc cannot say who the parent's parent is: the parent must not change
        self.caught: Optional[int] = None  # the first signal
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        if self.caught is None:
            self.caught = signum
        elif signum == signal.SIGINT:  # SIGTERM repeats (a launcher forwarding, a scheduler) ask nothing new
            raise KeyboardInterrupt

    def agreed(self, ctx) -> bool:
        """Whether any rank of ``ctx`` caught a signal: the same answer on every rank (a collective over the
        context's host group, else its groups; outside its byte counts)."""
        groups = [comm.group for comm in (ctx.mp, ctx.pp, ctx.dp) if comm is not None and comm.size > 1]
        if not groups:  # alone: no device round trip (it would wait for every step queued on the device)
            return self.caught is not None
        if ctx.host_group is not None:  # on the host: a device's queue goes on filling while the ranks agree
            flag = torch.tensor([int(self.caught is not None)], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.host_group)
            return bool(flag.item())
        flag = torch.tensor([int(self.caught is not None)], dtype=torch.int32, device=ctx.device)
        for group in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def check_launcher(self) -> None:
        """Raise ``LauncherGone`` when this rank's launcher has died. A rank forked from the launcher's forkserver
        checks the forkserver's parent: between the launcher's death and the forkserver's (its parent-death
        signal), the forkserver is still this rank's parent, and a busy host may run several steps in between."""
        if self.launcher_pid is None:
            return
        parent = os.getppid()
        if parent == self.launcher_pid:
            return
        grandparent = parent_of(parent)
        if grandparent != self.launcher_pid and (grandparent is not None or parent != self._parent):
            raise LauncherGone(f"the launcher (pid {self.launcher_pid}) that started this rank is gone; the rank "
                               "stops without writing a checkpoint")
