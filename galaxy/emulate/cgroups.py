"""Per-rank CPU: where each rank runs, its cgroup v1 cpu group ``/sys/fs/cgroup/cpu/<run>/rank<i>``
(weight and quota), and the filler processes that take the rest of a partly used core
(``/sys/fs/cgroup/cpu/<run>/filler<cpu>``).

The groups also track every process a rank starts (children of a cgroup member stay in it), which
is how teardown finds and kills them all, fillers included, before removing the groups.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from galaxy.config import ConfigError
from galaxy.emulate.cluster import Cluster
from galaxy.emulate.host import CPU_CGROUP_ROOT

logger = logging.getLogger(__name__)

# cpu.shares: a core's worth of weight is CORE_WEIGHT, so an emulated rank outweighs the host's
# other processes (1024 each) and gets its share on a busy host too
DEFAULT_WEIGHT, CORE_WEIGHT, MAX_WEIGHT = 1024, 16 * 1024, 1 << 18
MIN_FILLER_SHARE = 0.01  # less of a core left over is not worth a filler


@dataclass(frozen=True)
class RankCpu:
    cpus: Optional[tuple[int, ...]]  # pinned to these; None: anywhere
    weight: int  # cpu.shares
    quota_us: Optional[int]  # cpu.cfs_quota_us; None: no cap


@dataclass(frozen=True)
class Placement:
    ranks: tuple[RankCpu, ...]
    fillers: tuple[tuple[int, int], ...]  # (cpu, weight): a busy loop pinned there


def placement(cluster: Cluster, cpus: Sequence[int]) -> Placement:
    """Where the ranks of ``cluster`` run on a host whose usable cores are ``cpus``.

    ``cpu_emulation`` "cores": a rank of k whole cores gets k cores of its own; a rank of less than a
    core gets a core of its own while there are cores left (else it shares the least loaded one it
    fits on), weighted by its share, the rest of the core weighted to a filler, so a computing rank
    gets its share of the core whatever the others do; ranks sharing a core are capped by a quota
    too, or one would compute faster while its neighbour waits. "dilate": every rank with a share
    gets cores of its own, one below a whole core (its process stretches its ops, ``slowdown.py``).
    "quota": a quota per rank, no pinning, no fillers."""
    specs = cluster.ranks
    if cluster.cpu_emulation == "quota":
        return Placement(tuple(RankCpu(None, DEFAULT_WEIGHT if cluster.quota_us(r) is None else CORE_WEIGHT,
                                       cluster.quota_us(r)) for r in range(cluster.world_size)), ())
    for r, spec in enumerate(specs):
        if spec.compute_share is not None and spec.compute_share > 1 and not spec.compute_share.is_integer():
            raise ConfigError(f"cluster key 'ranks[{r}].compute_share' {spec.compute_share:g} is more than one core "
                              "but not a whole number of cores; use whole cores above one, or set "
                              "'cpu_emulation': 'quota'")
    if cluster.cpu_emulation == "dilate":
        return _own_cores(cluster, cpus)
    order = sorted(range(len(specs)), key=lambda r: -(specs[r].compute_share or 0))
    whole = [r for r in order if specs[r].compute_share is not None and specs[r].compute_share >= 1]
    parts = [r for r in order if specs[r].compute_share is not None and specs[r].compute_share < 1]
    free = len(cpus) - sum(int(specs[r].compute_share) for r in whole)
    bins: list[list[int]] = [[] for _ in range(max(free, 0))]  # ranks below one core, per core left
    load = lambda b: sum(specs[o].compute_share for o in b)  # noqa: E731
    misfit = free < 0
    for r in parts:  # largest first, each onto the least loaded core it fits: alone while cores last
        fits = [b for b in bins if load(b) + specs[r].compute_share <= 1 + 1e-9]
        misfit = misfit or not fits
        if fits:
            min(fits, key=load).append(r)
    if misfit:
        shares = [s.compute_share for s in specs if s.compute_share is not None]
        raise ConfigError(f"the cluster's compute shares ({', '.join(f'{s:g}' for s in shares)} cores) do not fit the "
                          f"{len(cpus)} cores of this machine; lower the shares (ranks below one core can share a "
                          "core), or set the cluster key 'cpu_emulation': 'quota' to oversubscribe")
    taken, cores = 0, {}
    for r in whole:
        n = int(specs[r].compute_share)
        cores[r] = tuple(cpus[taken:taken + n])
        taken += n
    ranks: dict[int, RankCpu] = {r: RankCpu(c, CORE_WEIGHT * len(c), None) for r, c in cores.items()}
    fillers = []
    for b, cpu in zip(bins, cpus[taken:]):
        for r in b:
            ranks[r] = RankCpu((cpu,), max(2, round(CORE_WEIGHT * specs[r].compute_share)),
                               cluster.quota_us(r) if len(b) > 1 else None)
        rest = 1 - load(b)
        if b and rest >= MIN_FILLER_SHARE:
            fillers.append((cpu, max(2, round(CORE_WEIGHT * rest))))
    return Placement(tuple(ranks.get(r, RankCpu(None, DEFAULT_WEIGHT, None)) for r in range(len(specs))),
                     tuple(fillers))


def _own_cores(cluster: Cluster, cpus: Sequence[int]) -> Placement:
    """``dilate``: whole cores per rank, in rank order, no filler and no quota."""
    need = [max(1, int(s.compute_share)) if s.compute_share is not None else 0 for s in cluster.ranks]
    if sum(need) > len(cpus):
        raise ConfigError(f"cluster key 'cpu_emulation' 'dilate' gives every rank cores of its own: {sum(need)} "
                          f"for these {cluster.world_size} ranks, but this machine has {len(cpus)}; use fewer "
                          "ranks, or 'cpu_emulation': 'cores' (ranks below one core share one)")
    ranks, taken = [], 0
    for n in need:
        ranks.append(RankCpu(tuple(cpus[taken:taken + n]), CORE_WEIGHT * n, None) if n else
                     RankCpu(None, DEFAULT_WEIGHT, None))
        taken += n
    return Placement(tuple(ranks), ())


def host_cpus() -> list[int]:
    """The cores this process may run on (and so the ranks it starts)."""
    return sorted(os.sched_getaffinity(0))


def run_group(run_name: str) -> str:
    return os.path.join(CPU_CGROUP_ROOT, run_name)


def rank_group(run_name: str, rank: int) -> str:
    return os.path.join(run_group(run_name), f"rank{rank}")


def filler_group(run_name: str, cpu: int) -> str:
    return os.path.join(run_group(run_name), f"filler{cpu}")


def build(run_name: str, cluster: Cluster, place: Placement) -> None:
    """One group per rank and per filler under the run's group, with the placement's weights and
    quotas. The run's group weighs the sum of its members, as if they were side by side at the top."""
    top = run_group(run_name)
    os.mkdir(top)
    weights = []
    groups = [(rank_group(run_name, r), rc.weight, rc.quota_us) for r, rc in enumerate(place.ranks)]
    groups += [(filler_group(run_name, cpu), weight, None) for cpu, weight in place.fillers]
    for group, weight, quota in groups:
        os.mkdir(group)
        _write(group, "cpu.cfs_period_us", cluster.cpu_period_us)
        _write(group, "cpu.cfs_quota_us", -1 if quota is None else quota)
        _write(group, "cpu.shares", weight)
        weights.append(weight)
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
