"""Heartbeats: when a rank dies, the others name it and exit instead of hanging or failing with an
anonymous socket error.

Every rank runs one daemon thread that, each ``interval`` seconds, bumps its counter
``galaxy/alive/<rank>`` in the rendezvous TCPStore (hosted by rank 0) and reads every peer's. A
peer whose counter stops moving died or froze (SIGKILL, the OOM killer, a lost node). A rank that
leaves writes why instead of a number: ``done`` (a clean shutdown), ``failed`` (after an error of
its own), ``exited`` (the interpreter ended without a shutdown). Staleness is measured on this
rank's monotonic clock, so clocks need not agree across machines, and over this rank's own reads: a
peer is silent for ``s`` seconds when reads of the store at least an interval apart, spanning ``s``,
saw its counter stand still. A pause of this process or of the store's host (a busy host, a VM
stalled) delays reads without making a peer look silent. When rank 0, the store's host, is the one
that died, its connection fails, which names it as well; a store that merely does not answer names
it only after ``stale_after``.

A failure surfaces in two ways, both naming the rank:

- ``explain(error)``: after a collective fails (Gloo: "Connection closed by peer", which names only
  an address), the caller asks which peer is behind it; this waits a few heartbeats for the dead
  peer's counter to stall and returns a ``RankFailure``. The CLI prints it as one line, exit 1.
- the watchdog: a rank can be stuck where no error comes soon (a peer frozen with its sockets
  open; NCCL). Once a peer has been silent for ``stale_after`` (half the collective timeout), the
  thread logs the failure; if the process is still running ``grace`` (a quarter of it) later, it
  ends it with exit code 1, as torch's NCCL watchdog does. So every survivor exits within the
  collective timeout.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

ALIVE_KEY = "galaxy/alive/{}"
DONE, FAILED, EXITED = "done", "failed", "exited"
LEFT = (DONE, FAILED, EXITED)
# Words in the errors a collective raises when a peer is gone (Gloo, NCCL, HCCL, the c10d store).
_COMM_WORDS = ("gloo", "nccl", "hccl", "c10d", "connection", "peer", "broken pipe", "timed out", "timeout", "socket")


class RankFailure(RuntimeError):
    """Another rank died, froze or failed; ``ranks`` are the global ranks named in the message."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` looks like a collective or store failure (one a dead peer causes)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in _COMM_WORDS)


class Seen(NamedTuple):
    """A peer's counter as this rank's reads of the store found it."""

    value: str
    since: float  # when a read first found this value (this rank's monotonic clock)
    reads: int = 0  # reads since then that found it unchanged


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


@dataclass(frozen=True)
class Schedule:
    """The heartbeat's times, in seconds, for a collective timeout of ``timeout_s``."""

    interval: float  # between beats (and reads of the peers' counters)
    # After a failed collective, a peer silent for `window` is the cause. With no error to go on,
    # silence must last longer (`stale_after`): a busy process (a big import holds the GIL) can skip beats.
    window: float
    stale_after: float
    grace: float  # for the main thread to report the failure before the watchdog exits

    @classmethod
    def for_timeout(cls, timeout_s: float) -> "Schedule":
        interval = min(1.0, max(0.1, timeout_s / 20))
        return cls(interval, 3 * interval, max(3 * interval, timeout_s / 2), timeout_s / 4)

    @property
    def watchdog_exit_s(self) -> float:
        """The latest a survivor's watchdog ends it after a peer's last beat, counted on the survivor's clock
        as its heartbeat thread runs: the beat is read up to an interval late, the silence judged and the
        grace checked once an interval each."""
        return self.stale_after + self.grace + 3 * self.interval

    @property
    def explain_wait_s(self) -> float:
        """The longest ``explain`` waits for a dead peer's counter to stall while the store answers."""
        return 2 * self.window + self.interval

    @property
    def explain_late_store_wait_s(self) -> float:
        """The longest it waits while the store is late (its silence names rank 0 after ``stale_after``)."""
        return self.stale_after + self.interval

    def reads_for(self, seconds: float) -> int:
        """How many reads, an interval apart at least, span ``seconds``."""
        return math.ceil(seconds / self.interval - 1e-9)


class Heartbeat:
    """This rank's heartbeat and watchdog (see the module doc); ``stop`` it before leaving."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 exit_on_failure: bool = True):
        self.host, self.port, self.rank = host, port, rank
        self.peers = [r for r in range(world_size) if r != rank]
        self.schedule = Schedule.for_timeout(timeout_s)
        self.exit_on_failure = exit_on_failure
        # Its own connection: the process group's store client is not shared with this thread. A store
        # that does not answer within stale_after counts as gone.
        self._store: Optional[dist.Store] = dist.TCPStore(
            host, port, None, False, timeout=datetime.timedelta(seconds=self.schedule.stale_after),
            wait_for_workers=False)
        now = time.monotonic()
        self._beats = 0
        self._seen = {r: Seen("", now) for r in self.peers}
        self._store_ok = now
        self._store_error = ""
        self._failure: Optional[RankFailure] = None
        self._failure_at = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"galaxy-heartbeat-rank{rank}", daemon=True)
        self._thread.start()
        # A script that ends without ctx.shutdown() still tells its peers it left on purpose.
        atexit.register(self._at_exit)

    # -- the thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._tick()
            self._stopping.wait(self.schedule.interval)

    def _tick(self) -> None:
        values = None
        store = self._store
        if store is not None:
            try:
                self._beats += 1
                store.set(ALIVE_KEY.format(self.rank), str(self._beats))
                values = store.multi_get([ALIVE_KEY.format(r) for r in self.peers]) if self.peers else []
            except Exception as e:  # a broken store connection does not recover: stop using it
                self._store = None
                self._store_error = str(e).splitlines()[0] if str(e) else type(e).__name__
        now = time.monotonic()
        with self._lock:
            if values is not None:
                self._store_ok = now
                for r, v in zip(self.peers, values):
                    v, seen = v.decode(), self._seen[r]
                    self._seen[r] = seen._replace(reads=seen.reads + 1) if v == seen.value else Seen(v, now)
            if self._failure is None:
                self._failure = self._diagnose(now, self.schedule.stale_after, include_exited=False)
                if self._failure is not None:
                    self._failure_at = now
                    logger.error("%s", self._failure)
            failure, since = self._failure, now - self._failure_at
        if failure is not None and self.exit_on_failure and since >= self.schedule.grace and \
                not self._stopping.is_set():
            logger.critical("%s; rank %d is still running %.1f s later, so it exits now", failure, self.rank, since)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # a closed stream must not keep the process alive
                    pass
            os._exit(1)  # the main thread may be blocked inside a collective, where no exception reaches it

    def _unchanged(self, seen: Seen, after: float) -> bool:
        """Whether this rank's reads found ``seen`` unchanged for ``after`` seconds (judged at the store's last
        answer, so a lost store does not make every peer look silent)."""
        return seen.reads >= self.schedule.reads_for(after) and self._store_ok - seen.since >= after

    def _quiet(self, after: float) -> list[int]:
        """The peers still in the run whose counters this rank's reads found unchanged for ``after`` seconds."""
        return [r for r, seen in self._seen.items() if seen.value not in LEFT and self._unchanged(seen, after)]

    def _diagnose(self, now: float, after: float, include_exited: bool) -> Optional[RankFailure]:
        """The failed peer(s) as seen at ``now``: silent for ``after`` seconds, or left after an error
        (or, with ``include_exited``, left without a shutdown). Call with the lock held."""
        silent = self._quiet(after)
        if silent:
            return self._silent(silent, now)
        # A store whose connection failed is gone; one that only has not answered may be late (its host, or this
        # process, paused), and names rank 0 only when silent as long as a peer must be with no error to go on.
        store_after = after if self._store_error else max(after, self.schedule.stale_after)
        if self.rank != 0 and now - self._store_ok >= store_after:
            state = self._seen[0].value
            if state in (FAILED, EXITED):
                # Rank 0 left first, taking the store with it; when it failed because a peer had gone
                # quiet, that peer is the cause.
                quiet = self._quiet(2 * self.schedule.interval)
                return self._silent(quiet, now) if quiet and state == FAILED else self._left([0], state)
            why = f" ({self._store_error})" if self._store_error else ""
            return RankFailure(f"rank 0 stopped responding: the rendezvous store it hosts at {self.host}:{self.port} "
                               f"has not answered for {now - self._store_ok:.1f} s{why}; the other ranks are exiting",
                               [0])
        # A peer that left after an error is named once it has been gone for ``after`` too: it may have
        # failed because another peer went silent, and that one is the cause.
        for state in (FAILED, EXITED) if include_exited else (FAILED,):
            left = [r for r, seen in self._seen.items() if seen.value == state and self._unchanged(seen, after)]
            if left:
                return self._left(left, state)
        return None

    def _silent(self, ranks: list[int], now: float) -> RankFailure:
        age = max(now - self._seen[r].since for r in ranks)
        return RankFailure(f"{_ranks_text(ranks)} stopped responding (no heartbeat for {age:.1f} s); "
                           "the other ranks are exiting", ranks)

    @staticmethod
    def _left(ranks: list[int], state: str) -> RankFailure:
        how = "stopped after an error of its own" if state == FAILED else "exited without shutting down"
        return RankFailure(f"{_ranks_text(ranks)} {how} (see its output); the other ranks are exiting", ranks)

    # -- the caller's side

    def explain(self, error: Optional[BaseException] = None) -> Optional[RankFailure]:
        """The peer failure behind ``error`` (a failed collective), or None when no peer failed. A
        collective fails as soon as a dead peer's sockets close, before its heartbeat looks stale, so
        this waits a few heartbeats for the counters to tell."""
        with self._lock:
            if self._failure is not None:
                return self._failure
        if (error is not None and not is_comm_error(error)) or not self._thread.is_alive():
            return None
        start = time.monotonic()
        deadline, last_resort = start + self.schedule.explain_wait_s, start + self.schedule.explain_late_store_wait_s
        while True:
            now = time.monotonic()
            with self._lock:
                failure = self._diagnose(now, self.schedule.window, include_exited=True)
                # A late store (its host or this process paused): what was read is old; wait as long again for new
                # reads once it answers.
                if self._store is not None and now - self._store_ok >= self.schedule.window:
                    deadline = max(deadline, now + self.schedule.explain_wait_s)
            if failure is not None or now >= min(deadline, last_resort):
                return failure
            time.sleep(self.schedule.interval / 4)

    def stop(self, state: str = DONE) -> None:
        """Stop the thread and leave ``state`` (done / failed / exited) for the peers to read."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self._at_exit)
        self._thread.join(timeout=2 * self.schedule.interval)
        store, self._store = self._store, None
        if store is not None and not self._thread.is_alive():  # never two users of one connection
            try:
                store.set(ALIVE_KEY.format(self.rank), state)
                if self.rank == 0 and state != DONE and self._some_peer_quiet():
                    self._linger(store)
            except Exception as e:  # rank 0 is gone already; nobody is left to tell
                logger.debug("could not record rank %d as %s: %s", self.rank, state, e)

    def _some_peer_quiet(self) -> bool:
        with self._lock:
            return bool(self._quiet(2 * self.schedule.interval))

    def _linger(self, store: dist.Store) -> None:
        """Rank 0 hosts the store: leaving at once after a peer went quiet would take it away before the
        other survivors read which rank that was (they would blame rank 0). Wait until every peer has
        left or gone silent, for at most the time ``explain`` takes to decide."""
        keys = [ALIVE_KEY.format(r) for r in self.peers]
        start = time.monotonic()
        seen = {k: (None, start) for k in keys}
        while True:
            now = time.monotonic()
            for k, v in zip(keys, store.multi_get(keys)):
                v = v.decode()
                if v != seen[k][0]:
                    seen[k] = (v, now)
            if all(v in LEFT or now - t >= self.schedule.window for v, t in seen.values()):
                return
            if now - start >= 2 * self.schedule.window + 2 * self.schedule.interval:
                return
            time.sleep(self.schedule.interval / 4)

    def _at_exit(self) -> None:
        self.stop(EXITED)
