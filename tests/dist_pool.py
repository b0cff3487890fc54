"""A pool of CPU/Gloo worker processes that serves many test cases.

Starting processes and a Gloo group costs seconds, so one pool of ``MAX_WORLD`` ranks is started
per test session; a test asks it to run a module-level function ``fn(ctx, *args)`` on the first
``world`` ranks, where ``ctx`` is a ParallelContext whose mp group holds exactly those ranks, or,
with ``dp=`` / ``pp=``, one whose mp, pp and dp groups split those ranks as ``world = dp x pp x mp``
(``galaxy.core.context.build_groups``; every pool process takes part in creating the groups, as
``dist.new_group`` requires, and they are kept for the next task with the same layout).
"""

from __future__ import annotations

import importlib
import multiprocessing.util
import os
import queue
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from galaxy.cli.launch import STOP_SIGNALS, die_with_launcher, free_port
from galaxy.cli.rank_processes import Handover, leave_forkserver, rank_process_context

MAX_WORLD = 4
TASK_TIMEOUT_S = 120


def _worker(rank: int, world: int, port: int, tasks, results, root: str, handover: Handover, owner: int) -> None:
    # Forked from the forkserver local launches use (torch and Galaxy imported there once): take the owner's
    # environment and streams, die with it, and take stop signals as a spawned process would (the forkserver
    # blocks them for its ranks, see galaxy.cli.rank_forkserver).
    handover.take()
    leave_forkserver()
    die_with_launcher(owner)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    sys.path.insert(0, root)
    torch.set_num_threads(1)
    from galaxy.config import DistributedConfig
    from galaxy.core.comm import Communicator
    from galaxy.core.context import ParallelContext, build_groups

    base = ParallelContext.initialize(DistributedConfig(init_method=f"tcp://127.0.0.1:{port}", timeout_s=60),
                                      rank, world, "cpu")
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}
    grad_groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}  # ParallelContext.mp_grad
    layouts = {}
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, size, args, (dp, pp) = task
        if (dp, pp) != (1, 1) and (size, dp, pp) not in layouts:
            layouts[(size, dp, pp)] = build_groups(rank, size, dp, pp)
        if rank >= size:
            results.put((rank, "skip", None))
            continue
        if (dp, pp) == (1, 1):
            ctx = ParallelContext(rank=rank, world_size=size, device=torch.device("cpu"), seed=0,
                                  mp=Communicator("mp", rank, size, groups.get(size)),
                                  mp_grad=Communicator("mp_grad", rank, size, grad_groups.get(size)))
        else:
            ctx = ParallelContext(rank=rank, world_size=size, device=torch.device("cpu"), seed=0,
                                  **layouts[(size, dp, pp)])
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, "ok", fn(ctx, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    base.shutdown()
    # As the launcher's ranks end (galaxy.cli.launch._child): multiprocessing's own cleanup (the results queue's
    # feeder flushed), then os._exit, which skips the interpreter's finalization: with torch._dynamo imported that
    # took about 1.3 s of CPU a worker (2026-12-03), at each pool's close, the last thing a pytest worker waits for.
    multiprocessing.util._exit_function()
    os._exit(0)


class DistPool:
    """``MAX_WORLD`` worker processes joined in one Gloo group. A task whose ranks do not all answer (a worker
    died, or ranks stuck in a collective that others left) fails at once with the ranks named, and the pool
    is replaced before the next task: one broken task costs one test, not a timeout in every later one."""

    def __init__(self, world: int = MAX_WORLD):
        self.world = world
        self.procs: list = []
        self._start()

    def _start(self):
        # Forked as a launch's local ranks are (galaxy.cli.rank_processes), not spawned: a spawned worker imported
        # torch, torch._dynamo and Galaxy again, seconds of CPU for each of the suite's pool workers.
        context = rank_process_context()
        self.tasks = [context.Queue() for _ in range(self.world)]
        self.results = context.Queue()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        port, handover = free_port(), Handover.from_launcher()
        self.procs = [context.Process(target=_worker, args=(r, self.world, port, self.tasks[r], self.results, root,
                                                            handover, os.getpid()), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, size: int, *args, dp: int = 1, pp: int = 1):
        """``fn(ctx, *args)`` on ranks 0..size-1; returns their results in rank order."""
        assert 1 <= size <= self.world and size % (dp * pp) == 0
        if not all(p.is_alive() for p in self.procs):
            self._replace()
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, size, args, (dp, pp)))
        out, errors, waiting = [None] * size, [], set(range(self.world))
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while waiting:
            try:
                rank, status, value = self.results.get(timeout=1)
            except queue.Empty:
                dead = [r for r in sorted(waiting) if not self.procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    why = (f"pool worker(s) {dead} died (exit codes {[self.procs[r].exitcode for r in dead]})"
                           if dead else f"ranks {sorted(waiting)} did not answer in {TASK_TIMEOUT_S} s")
                    self._replace()
                    raise AssertionError(f"{fn.__name__}: {why}; the pool was replaced") from None
                continue
            waiting.discard(rank)
            if status == "ok":
                out[rank] = value
            elif status == "error":
                errors.append(f"--- rank {rank}:\n{value}")
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return out

    def _replace(self):
        """Kill every worker (some may be inside a collective that will never finish) and start new ones."""
        for p in self.procs:
            p.kill()
            p.join(timeout=10)
        self._start()

    def close(self):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
