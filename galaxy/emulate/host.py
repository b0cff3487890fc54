"""What emulation needs from this machine, and running its tools with errors that say what failed."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence

CPU_CGROUP_ROOT = "/sys/fs/cgroup/cpu"  # the cgroup v1 cpu controller's hierarchy
TOOLS = ("ip", "tc", "setpriv", "taskset")  # iproute2 (ip, tc) and util-linux (setpriv, taskset)


class EmulationUnavailable(RuntimeError):
    """This machine cannot emulate a cluster; the message (one line) says what is missing and the fix."""


class HostCommandError(RuntimeError):
    """A tool (ip, tc) failed while building or removing the emulated cluster."""


def missing_prerequisite() -> str | None:
    """Why this machine cannot emulate a cluster (one line), or None when it can."""
    if os.geteuid() != 0:
        return "cluster emulation needs root (network namespaces, tc, cgroups); run as root"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            package = "util-linux" if tool in ("setpriv", "taskset") else "iproute2"
            return f"cluster emulation needs the '{tool}' command; install {package} (apt-get install {package})"
    quota = os.path.join(CPU_CGROUP_ROOT, "cpu.cfs_quota_us")
    if not os.path.isfile(quota):
        return (f"cluster emulation needs the cgroup v1 cpu controller at {CPU_CGROUP_ROOT} (no {quota}); "
                "mount it: mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu")
    if not os.access(CPU_CGROUP_ROOT, os.W_OK):
        return f"cluster emulation cannot create cgroups under {CPU_CGROUP_ROOT} (read-only); mount it writable"
    return None


def require_prerequisites() -> None:
    reason = missing_prerequisite()
    if reason is not None:
        raise EmulationUnavailable(reason)


def run(argv: Sequence[str]) -> str:
    """Run a tool, returning its stdout; a failure raises HostCommandError naming the command."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise HostCommandError(f"'{' '.join(argv)}' did not finish within 60 s") from None
    if done.returncode != 0:
        said = "; ".join(line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip())
        raise HostCommandError(f"'{' '.join(argv)}' failed: {said or f'exit code {done.returncode}'}")
    return done.stdout
