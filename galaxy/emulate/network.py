"""The emulated network: one namespace per rank, star-wired by veth pairs to a switch namespace.

Rank i's namespace ``<run>-rank<i>`` holds one interface, ``gxlink`` (address 10.200.x.y/16), whose
peer ``port<i>`` sits on a bridge inside ``<run>-switch``. Nothing is created in the host's own
namespace, so deleting the run's namespaces removes every interface, the bridge and every qdisc.
A rank's bandwidth is shaped by a token bucket (tbf) on both ends of its veth pair: on ``gxlink``
(what the rank sends) and on ``port<i>`` (what it receives), so traffic from rank i to rank j runs at
min(bw_i, bw_j) and a rank's link is shared by all its peers, like a switch port.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from galaxy.emulate.cluster import Cluster
from galaxy.emulate.host import run

logger = logging.getLogger(__name__)

RANK_INTERFACE = "gxlink"  # the same name in every rank's namespace: GLOO_SOCKET_IFNAME
BRIDGE = "switch"
SUBNET_PREFIX_LEN = 16
TBF_LATENCY_MS = 50  # queue length of each tbf, as time at the shaped rate


def switch_namespace(run_name: str) -> str:
    return f"{run_name}-switch"


def rank_namespace(run_name: str, rank: int) -> str:
    return f"{run_name}-rank{rank}"


def rank_address(rank: int) -> str:
    host = rank + 1  # 10.200.0.0 is the network's own address
    return f"10.200.{host >> 8}.{host & 255}"


def tbf_burst_bytes(bandwidth_mbit: float) -> int:
    """The bucket: 2 ms of traffic, at least a few full frames (a tbf smaller than one frame stalls)."""
    return max(16 * 1024, int(bandwidth_mbit * 1e6 / 8 * 0.002))


def build(run_name: str, cluster: Cluster) -> None:
    """Create the switch and every rank's namespace, wired and shaped. Partial state on failure is
    left for ``remove`` (the caller always calls it)."""
    switch = switch_namespace(run_name)
    run(["ip", "netns", "add", switch])
    run(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
    for rank, spec in enumerate(cluster.ranks):
        ns, port = rank_namespace(run_name, rank), f"port{rank}"
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", "name", port, "netns", switch, "type", "veth",
             "peer", "name", RANK_INTERFACE, "netns", ns])
        run(["ip", "-n", switch, "link", "set", port, "master", BRIDGE])
        run(["ip", "-n", switch, "link", "set", port, "up"])
        # IPv4 only: Gloo takes the interface's first address, which must not be an IPv6 link-local one
        run(["ip", "-n", ns, "link", "set", RANK_INTERFACE, "addrgenmode", "none"])
        run(["ip", "-n", ns, "addr", "add", f"{rank_address(rank)}/{SUBNET_PREFIX_LEN}", "dev", RANK_INTERFACE])
        run(["ip", "-n", ns, "link", "set", RANK_INTERFACE, "up"])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if spec.bandwidth_mbit is not None:
            shape(ns, RANK_INTERFACE, spec.bandwidth_mbit)  # rank -> switch
            shape(switch, port, spec.bandwidth_mbit)  # switch -> rank
    logger.debug("network %s: %d ranks on bridge %s/%s", run_name, cluster.world_size, switch, BRIDGE)


def shape(namespace: str, device: str, bandwidth_mbit: float) -> None:
    rate_bit = int(round(bandwidth_mbit * 1e6))
    run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_bit}bit",
         "burst", str(tbf_burst_bytes(bandwidth_mbit)), "latency", f"{TBF_LATENCY_MS}ms"])


def namespaces_of(run_name: str) -> list[str]:
    pattern = re.compile(re.escape(run_name) + r"-(switch|rank\d+)$")
    return [n for n in list_namespaces() if pattern.match(n)]


def list_namespaces() -> list[str]:
    # `ip netns list` prints "name (id: N)" for namespaces with an id
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def kill_processes_in(namespace: str) -> int:
    """SIGKILL every process living in the namespace; returns how many were signalled."""
    try:
        pids = [int(p) for p in run(["ip", "netns", "pids", namespace]).split()]
    except RuntimeError:
        return 0  # already gone
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def remove(namespaces: list[str]) -> list[str]:
    """Kill what runs in the namespaces and delete them (their veths, bridge and qdiscs go with them).
    Returns what could not be removed, as messages."""
    problems = []
    for ns in namespaces:
        kill_processes_in(ns)
        try:
            run(["ip", "netns", "del", ns])
        except RuntimeError as e:
            problems.append(str(e))
    return problems
