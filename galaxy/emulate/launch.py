"""``run_emulated``: start every rank on an emulated cluster, watch them, stop them all on a failure.

Exit codes: 0 when every rank succeeded; otherwise the code of the rank to blame (a rank killed by a
signal is blamed before ranks that failed after it, then the lowest rank), a signal N reported as
128 + N; 128 + N as well when the launcher itself got SIGINT/SIGTERM/SIGHUP N. Whatever happens, the
cluster is removed before this returns or raises.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from galaxy.emulate.cluster import Cluster
from galaxy.emulate.emulator import DEFAULT_MASTER_PORT, EmulatedCluster

logger = logging.getLogger(__name__)

POLL_S = 0.05
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class LauncherInterrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"the launcher got {signal.Signals(signum).name}")
        self.signum = signum


def run_emulated(cluster: Cluster, argv_for_rank: Callable[[int], Sequence[str]],
                 env: Optional[Mapping[str, str]] = None, master_port: int = DEFAULT_MASTER_PORT,
                 grace_s: float = 5.0) -> int:
    """Run ``argv_for_rank(r)`` as every rank r of ``cluster`` (each with RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and GLOO_SOCKET_IFNAME added to ``env``, default this process's environment) and
    return the exit code described in this module's docstring. When a rank fails, or the launcher is
    told to stop, the remaining ranks get SIGTERM and, ``grace_s`` later, SIGKILL."""
    with _StopSignalsRaise():
        try:
            with EmulatedCluster(cluster, master_port=master_port) as emu:
                procs = [emu.spawn(r, list(argv_for_rank(r)), env) for r in range(cluster.world_size)]
                try:
                    return _supervise(procs, grace_s)
                except LauncherInterrupted as e:
                    logger.error("%s; stopping the ranks and removing emulated cluster %s", e, emu.name)
                    _stop(procs, grace_s)
                    return 128 + e.signum
        except LauncherInterrupted as e:  # arrived while the cluster was being built or removed
            logger.error("%s; the emulated cluster was removed", e)
            return 128 + e.signum


def _supervise(procs: list[subprocess.Popen], grace_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(code >= 0, rank) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank = min(failed)[1]
            code = codes[rank]
            running = [r for r, c in enumerate(codes) if c is None]
            logger.error("rank %d %s; %s", rank, describe_exit(code),
                         f"stopping ranks {running}" if running else "the other ranks have ended")
            _stop(procs, grace_s)
            return 128 - code if code < 0 else code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every running rank's process group (each rank leads its own), and wait up to ``grace_s``
    for them to end (the cluster's teardown SIGKILLs whatever is left)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _StopSignalsRaise:
    """While active, SIGINT/SIGTERM/SIGHUP raise LauncherInterrupted in the main thread (so every
    ``with`` above unwinds and cleans up); the previous handlers come back on exit. Signals can only
    be caught in the main thread; elsewhere this does nothing and the caller's handlers apply."""

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._old[signum] = signal.signal(signum, self._raise)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._old.items():
            signal.signal(signum, handler)

    @staticmethod
    def _raise(signum, frame):
        raise LauncherInterrupted(signum)
