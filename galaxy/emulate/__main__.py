"""``python -m galaxy.emulate CLUSTER.json [--master-port P] -- COMMAND ...``: run COMMAND as every rank
of the emulated cluster (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME set) and exit
with run_emulated's code. Under ``cpu_emulation`` "dilate" the slower ranks also get
GALAXY_EMULATE_SLOWDOWN, which Galaxy's CLIs act on; another COMMAND computes at its cores' speed."""

from __future__ import annotations

import argparse
import logging
import sys

from galaxy.config import ConfigError
from galaxy.emulate.cluster import Cluster
from galaxy.emulate.emulator import DEFAULT_MASTER_PORT
from galaxy.emulate.host import EmulationUnavailable, HostCommandError
from galaxy.emulate.launch import run_emulated


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m galaxy.emulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("cluster", help="cluster file (JSON), see galaxy/emulate/cluster.py")
    parser.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL of the ranks")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(ours)
    if not command:
        parser.error("name the command to run after '--', e.g. -- python train.py")
    logging.basicConfig(level=args.log_level.upper(), format="galaxy.emulate: %(message)s", stream=sys.stderr)
    try:
        cluster = Cluster.from_file(args.cluster)
        return run_emulated(cluster, lambda rank: command, master_port=args.master_port, grace_s=args.grace)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (EmulationUnavailable, HostCommandError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
