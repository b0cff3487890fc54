"""``EmulatedCluster``: build a cluster's namespaces and cgroups, start ranks in them, remove it all.

Every run has a unique name ``galaxy-emu-<8 hex>`` that prefixes its namespaces and cgroup, and holds
an exclusive lock on ``/run/galaxy-emulate/<name>.lock`` while it lives. A run that died without
cleaning up (the launcher SIGKILLed, the machine lost power) leaves an unlocked name behind; the
next run finds such names and removes what they hold before building its own. Ranks get
``--pdeathsig KILL``, so they do not outlive a launcher that was killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import secrets
import signal
import subprocess
import time
from typing import Mapping, Optional, Sequence

from galaxy.emulate import cgroups, network
from galaxy.emulate.cluster import SLOWDOWN_ENV, Cluster
from galaxy.emulate.host import CPU_CGROUP_ROOT, require_prerequisites

logger = logging.getLogger(__name__)

LOCK_DIR = "/run/galaxy-emulate"
NAME_PATTERN = re.compile(r"galaxy-emu-[0-9a-f]{8}")
DEFAULT_MASTER_PORT = 29500  # every run has its own namespaces, so a fixed port never collides
# Run under `setpriv --pdeathsig KILL` (the process dies with the launcher): joins its cgroup, checks
# that the launcher did not die before the death signal was armed, then becomes the command (a rank's,
# inside its namespace, or a filler's busy loop; the same pid all along).
_ENTER = ('echo $$ > "$0" || exit 126; read -r _ _ _ parent _ < /proc/$$/stat; '
          '[ "$parent" = "$1" ] || exit 125; shift; exec "$@"')
_FILLER = ["sh", "-c", "while :; do :; done"]
_DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class EmulatedCluster:
    """Context manager: on enter, the cluster's network and CPU groups exist; on exit (any exit),
    every rank process is killed and everything created is removed.

    >>> with EmulatedCluster(cluster) as emu:
    ...     procs = [emu.spawn(r, ["python", "train.py"]) for r in range(cluster.world_size)]
    """

    def __init__(self, cluster: Cluster, master_port: int = DEFAULT_MASTER_PORT):
        self.cluster = cluster
        self.master_port = master_port
        self.name = ""
        self.processes: dict[int, subprocess.Popen] = {}
        self.fillers: list[subprocess.Popen] = []
        self.placement: Optional[cgroups.Placement] = None
        self._lock_fd: Optional[int] = None

    @property
    def master_addr(self) -> str:
        return network.rank_address(0)

    # -- lifecycle

    def __enter__(self) -> "EmulatedCluster":
        require_prerequisites()
        self.placement = cgroups.placement(self.cluster, cgroups.host_cpus())
        with _signals_blocked():
            self.name, self._lock_fd = _claim_name()
            try:
                remove_stale_runs()
                cgroups.build(self.name, self.cluster, self.placement)
                network.build(self.name, self.cluster)
                self.fillers = [self._start(cgroups.filler_group(self.name, cpu), (cpu,), _FILLER,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                                for cpu, _ in self.placement.fillers]
                for (cpu, _), proc in zip(self.placement.fillers, self.fillers):
                    _wait_joined(proc, cgroups.filler_group(self.name, cpu))
            except BaseException:
                self._teardown()
                raise
        logger.info("emulated cluster %s: %s", self.name, describe(self.cluster, self.placement))
        return self

    def __exit__(self, *exc) -> None:
        with _signals_blocked():
            self._teardown()

    def _teardown(self) -> None:
        for proc in [*self.processes.values(), *self.fillers]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        problems = remove_run(self.name)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if problems:
            # not raised: the exception that brought us here matters more, and the next run retries
            logger.error("emulated cluster %s was not fully removed: %s", self.name, "; ".join(problems))
        else:
            logger.debug("emulated cluster %s removed", self.name)

    # -- ranks

    def rank_env(self, rank: int, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus the rendezvous and Gloo variables, and
        the rank's slowdown under ``cpu_emulation`` "dilate"."""
        env = dict(os.environ if base is None else base)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.cluster.world_size), LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port),
                   GLOO_SOCKET_IFNAME=network.RANK_INTERFACE)
        share = self.cluster.ranks[rank].compute_share
        slowdown = self.cluster.slowdown(rank)
        if slowdown > 1:
            env[SLOWDOWN_ENV] = f"{slowdown:.6g}"
        else:
            env.pop(SLOWDOWN_ENV, None)
        if share is not None and "OMP_NUM_THREADS" not in env:
            # more threads than the share's cores only adds stalls
            env["OMP_NUM_THREADS"] = str(max(1, math.ceil(share)))
        return env

    def spawn(self, rank: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` as rank ``rank``: in its namespace and cgroup, with ``rank_env(rank, env)``,
        in a session of its own (a terminal's Ctrl-C reaches the launcher, which stops the ranks)."""
        if not self.name:
            raise RuntimeError("EmulatedCluster.spawn needs the cluster built: use it inside 'with'")
        if rank in self.processes:
            raise RuntimeError(f"rank {rank} was already started in emulated cluster {self.name}")
        proc = self._start(cgroups.rank_group(self.name, rank), self.placement.ranks[rank].cpus,
                           ["ip", "netns", "exec", network.rank_namespace(self.name, rank), *argv],
                           env=self.rank_env(rank, env), **popen_kwargs)
        self.processes[rank] = proc
        return proc

    def _start(self, group: str, cpus: Optional[tuple[int, ...]], argv: Sequence[str], **popen_kwargs):
        """``argv`` in ``group``, on ``cpus`` (None: anywhere), dying with this process, in a session
        of its own."""
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
        command = ["setpriv", "--pdeathsig", "KILL", "--", *pin, "sh", "-c", _ENTER,
                   os.path.join(group, "cgroup.procs"), str(os.getpid()), *argv]
        return subprocess.Popen(command, start_new_session=True, **popen_kwargs)


def _wait_joined(proc: subprocess.Popen, group: str, timeout_s: float = 10.0) -> None:
    """Return once ``proc`` (started by ``_start``) is a member of ``group``: it joins as its first step,
    after Popen has returned, so a cluster whose fillers are not yet in place is not yet the one described."""
    deadline = time.monotonic() + timeout_s
    while proc.pid not in cgroups.members(group):
        if proc.poll() is not None:
            raise RuntimeError(f"a process for {group} exited (code {proc.returncode}) before joining it")
        if time.monotonic() > deadline:
            raise RuntimeError(f"a process for {group} did not join it within {timeout_s:g} s")
        time.sleep(0.005)


def describe(cluster: Cluster, place: Optional[cgroups.Placement] = None) -> str:
    def one(rank: int) -> str:
        spec = cluster.ranks[rank]
        cpu = "no CPU limit" if spec.compute_share is None else f"compute_share {spec.compute_share:g}"
        if place is not None and place.ranks[rank].cpus:
            cpu += f" on cpu {','.join(map(str, place.ranks[rank].cpus))}"
        bw = "unshaped" if spec.bandwidth_mbit is None else f"{spec.bandwidth_mbit:g} Mbit/s"
        return f"rank {rank} {network.rank_address(rank)} {cpu}, {bw}"
    fillers = [f"cpu {cpu} {w / cgroups.CORE_WEIGHT:.2g}" for cpu, w in (place.fillers if place else ())]
    return "; ".join(one(r) for r in range(cluster.world_size)) + (f"; fillers: {', '.join(fillers)}" if fillers else "")


# ----------------------------------------------------------------------------- run names and leftovers


def _claim_name() -> tuple[str, int]:
    """A fresh run name and the open, locked descriptor of its lock file."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    while True:
        name = f"galaxy-emu-{secrets.token_hex(4)}"
        fd = _try_lock(name)
        if fd is not None:
            return name, fd


def _try_lock(name: str) -> Optional[int]:
    """Lock ``name``'s lock file; None if a live run holds it. Checks that the locked file is still the
    one at the path, since a sweeper may unlink a stale lock file between our open and flock."""
    path = os.path.join(LOCK_DIR, f"{name}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def remove_run(name: str) -> list[str]:
    """Kill every process of run ``name`` and remove its cgroups, namespaces and lock file; returns the
    problems (empty when all is gone)."""
    namespaces = network.namespaces_of(name)
    for ns in namespaces:  # first, so no rank is left to talk to a peer that is being removed
        network.kill_processes_in(ns)
    problems = cgroups.remove(name) + network.remove(namespaces)
    try:
        os.unlink(os.path.join(LOCK_DIR, f"{name}.lock"))
    except FileNotFoundError:
        pass
    return problems


def run_names() -> set[str]:
    """Names of every run that left something on this machine, alive or not."""
    found = {m.group(0) for ns in network.list_namespaces() if (m := NAME_PATTERN.match(ns))}
    for entries in (os.listdir(CPU_CGROUP_ROOT), os.listdir(LOCK_DIR) if os.path.isdir(LOCK_DIR) else []):
        found |= {m.group(0) for entry in entries if (m := NAME_PATTERN.match(entry))}
    return found


def remove_stale_runs() -> list[str]:
    """Remove the leftovers of runs whose launcher is gone (their lock is free); returns their names."""
    removed = []
    for name in sorted(run_names()):
        fd = _try_lock(name)
        if fd is None:
            continue  # a live run
        try:
            problems = remove_run(name)
        finally:
            os.close(fd)
        if problems:
            logger.warning("leftovers of emulated cluster %s: %s", name, "; ".join(problems))
        else:
            logger.info("removed the leftovers of emulated cluster %s (its launcher had died)", name)
        removed.append(name)
    return removed


@contextlib.contextmanager
def _signals_blocked():
    """Defer SIGINT/SIGTERM/SIGHUP (delivered on exit) so that building or removing is never cut halfway."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
