"""Per-rank CPU quotas: a cgroup v1 cpu group ``/sys/fs/cgroup/cpu/<run>/rank<i>`` per rank.

The group also tracks every process a rank starts (children of a cgroup member stay in it), which
is how teardown finds and kills them all before removing the groups.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time

from galaxy.emulate.cluster import Cluster
from galaxy.emulate.host import CPU_CGROUP_ROOT

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT, QUOTA_WEIGHT, MAX_WEIGHT = 1024, 16 * 1024, 1 << 18  # cpu.shares


def run_group(run_name: str) -> str:
    return os.path.join(CPU_CGROUP_ROOT, run_name)


def rank_group(run_name: str, rank: int) -> str:
    return os.path.join(run_group(run_name), f"rank{rank}")


def build(run_name: str, cluster: Cluster) -> None:
    """One group per rank under the run's group. A rank with a quota gets QUOTA_WEIGHT: its share is
    what it gets, not only a cap, so it outweighs the host's other load (and the quota keeps it from
    taking more). The run's group weighs the sum of its ranks, as if they were side by side at the top."""
    top = run_group(run_name)
    os.mkdir(top)
    weights = []
    for rank in range(cluster.world_size):
        group = rank_group(run_name, rank)
        os.mkdir(group)
        _write(group, "cpu.cfs_period_us", cluster.cpu_period_us)
        quota = cluster.quota_us(rank)
        _write(group, "cpu.cfs_quota_us", -1 if quota is None else quota)
        weights.append(DEFAULT_WEIGHT if quota is None else QUOTA_WEIGHT)
        _write(group, "cpu.shares", weights[-1])
    _write(top, "cpu.shares", min(MAX_WEIGHT, sum(weights)))


def _write(group: str, name: str, value: int) -> None:
    with open(os.path.join(group, name), "w") as f:
        f.write(str(value))


def members(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def remove(run_name: str, timeout_s: float = 10.0) -> list[str]:
    """SIGKILL every member of the run's groups and remove the groups. Returns what could not be
    removed, as messages."""
    top = run_group(run_name)
    if not os.path.isdir(top):
        return []
    groups = [os.path.join(top, d) for d in os.listdir(top) if os.path.isdir(os.path.join(top, d))] + [top]
    problems = []
    for group in groups:
        deadline = time.monotonic() + timeout_s
        while True:
            for pid in members(group):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(group)
                break
            except FileNotFoundError:
                break
            except OSError as e:  # EBUSY while killed members are still exiting
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    problems.append(f"could not remove cgroup {group}: {e}")
                    break
                time.sleep(0.02)
    return problems
