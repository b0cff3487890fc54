"""Emulated heterogeneous clusters on one Linux host: every rank in its own network namespace behind a
bandwidth-shaped link, with its own share of the host's cores (needs root, iproute2's ``ip`` and ``tc``,
util-linux's ``setpriv`` and ``taskset``, and the cgroup v1 cpu controller).

How the cluster file (``cluster.py``) maps onto the host:

- ``ranks[i]`` is rank i: network namespace ``<run>-rank<i>``, address ``10.200.0.<i+1>`` (from rank
  255 on ``10.200.1.0`` ...) on its interface ``gxlink`` (GLOO_SOCKET_IFNAME), and the cgroup
  ``/sys/fs/cgroup/cpu/<run>/rank<i>``.
- ``ranks[i].compute_share`` (CPU cores) -> ``cgroups.placement``: under ``cpu_emulation`` "cores" (the
  default) the rank is pinned to cores of its own, and below one core its cgroup's ``cpu.shares`` competes
  with a filler process (``/sys/fs/cgroup/cpu/<run>/filler<cpu>``) weighted to the rest of the core, a
  quota capping it only where two ranks share a core; under "quota" that cgroup's ``cpu.cfs_quota_us`` =
  share x ``cpu_period_us``; under "dilate" every rank gets cores of its own and a rank below one core
  the environment variable ``GALAXY_EMULATE_SLOWDOWN`` = 1 / share, on which Galaxy's CLI ranks
  stretch each op (``slowdown.py``). Weights are high so the rank gets its share on a busy host too;
  OMP_NUM_THREADS defaults to the share rounded up.
- ``ranks[i].bandwidth_mbit`` (default ``links.bandwidth_mbit``) -> a tbf qdisc at that rate on both ends
  of the rank's veth pair. All veths meet on a bridge in the namespace ``<run>-switch``: a star, so
  rank i sends to rank j at min(bw_i, bw_j) and shares its link among its peers like a switch port.
- MASTER_ADDR is rank 0's address; MASTER_PORT is the same in every run (the namespaces are private).

``<run>`` is ``galaxy-emu-<8 hex>``, unique per run. Everything is removed when the run ends, however
it ends; what a killed launcher left behind is removed by the next run. Entry points: ``run_emulated``
for launchers, ``EmulatedCluster`` (a context manager) for tests and benchmarks, and
``python -m galaxy.emulate CLUSTER.json -- COMMAND ...``.
"""

from galaxy.emulate.cluster import Cluster, RankSpec
from galaxy.emulate.emulator import EmulatedCluster, remove_stale_runs
from galaxy.emulate.host import EmulationUnavailable, HostCommandError, missing_prerequisite
from galaxy.emulate.launch import run_emulated

__all__ = ["Cluster", "RankSpec", "EmulatedCluster", "EmulationUnavailable", "HostCommandError",
           "missing_prerequisite", "remove_stale_runs", "run_emulated"]
