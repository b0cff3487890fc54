"""A slower device, op by op: under ``cpu_emulation: "dilate"`` a rank of share s < 1 gets a whole core,
and its process stretches every compute op it runs to 1 / s times the op's own duration.

Sharing a core (the filler of ``"cores"``, a CFS quota) makes a rank slower only on average over the
scheduler's slice: a short piece of compute right after a wait on the link runs at nearly full speed
(``bench/bench_share.py``), so a plan that alternates short pieces with collectives runs faster than
the profile of its blocks says. Stretching each op is faithful at every piece length, after any wait.
What it does not stretch: collectives (the link is emulated by the network), and the Python between
ops, which runs at the core's speed (like a host driving a slower accelerator).

The emulator tells a rank its slowdown in the environment variable ``GALAXY_EMULATE_SLOWDOWN``; every
Galaxy CLI rank (``galaxy.cli.launch.run_rank``) runs inside ``slowed_compute(slowdown_from_env())``.
Other programs started on such a cluster run at their core's full speed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator, Mapping, Optional

from torch.utils._python_dispatch import TorchDispatchMode

from galaxy.config import ConfigError
from galaxy.emulate.cluster import SLOWDOWN_ENV

MAX_SLOWDOWN = 1000.0
# Collectives and their waits: the emulated link decides how long they take.
_COMMUNICATION = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_SPIN_S = 0.001  # the last stretch of a wait is spun, not slept: a sleep may overshoot by ~0.1 ms


def slowdown_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The factor the emulator set for this rank; None when it set none."""
    raw = (os.environ if env is None else env).get(SLOWDOWN_ENV)
    if raw is None or raw == "":
        return None
    try:
        factor = float(raw)
    except ValueError:
        factor = float("nan")
    if not 1.0 <= factor <= MAX_SLOWDOWN:
        raise ConfigError(f"environment variable {SLOWDOWN_ENV}={raw!r} must be a number from 1 to "
                          f"{MAX_SLOWDOWN:g} (how many times slower this rank computes); the emulator sets it, "
                          "unset it outside one")
    return factor


@contextlib.contextmanager
def slowed_compute(factor: Optional[float]) -> Iterator[None]:
    """Inside, every op this thread dispatches (and the backward ops autograd runs for it) takes
    ``factor`` times its own time; ``None`` or 1: nothing changes."""
    if factor is None or factor == 1.0:
        yield
        return
    with StretchOps(factor):
        yield


def wait_until(until: float, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once ``clock()`` reaches ``until``: sleep most of the way (the core is free for the rank's
    communication threads meanwhile), spin the last ``_SPIN_S``."""
    left = until - clock()
    if left > 2 * _SPIN_S:
        sleep(left - _SPIN_S)
    while clock() < until:
        pass


class StretchOps(TorchDispatchMode):
    """Each op, once it returns, is followed by a wait of ``factor - 1`` times what it took.
    ``clock`` and ``wait_until`` are for tests: a fake clock and a recorded wait show what the mode
    asks for without depending on how busy the machine is."""

    def __init__(self, factor: float, clock: Callable[[], float] = time.perf_counter,
                 wait_until: Callable[[float], None] = wait_until):
        super().__init__()
        self.extra = factor - 1.0
        self._clock, self._wait_until = clock, wait_until

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = self._clock()
        out = func(*args, **(kwargs or {}))
        if func.namespace in _COMMUNICATION:
            return out
        end = self._clock()
        self._wait_until(end + (end - start) * self.extra)
        return out
