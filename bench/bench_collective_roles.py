"""How much later the member that comes last to a Gloo collective leaves than the members that waited for it.

Two ranks on an emulated cluster (``galaxy.emulate``, a core each) whose links are shaped to ``--mbit``;
the cluster profiler's own measurement (``galaxy.planner.profile.measure_group``: one member arriving
``STAGGER_S`` late, a different one each round) times each op at ``--mbytes``. Reported per op: the late
member's time (from its arrival until it leaves), the waiting members' time (until they leave, less the
wait), and the ratio. On a quiet machine the last member of an all-gather leaves 1.4-1.6x after the others
while an all-reduce lets them go together, which is why the cost model keeps both roles (measured on c10d's
all-gather; on Gloo Galaxy's all-gather is an all-to-all since the quickstart's heap corruption, dc70c5b:
not re-measured). A busy host
stretches the roles unevenly (a test once saw the all-reduce's two roles 19% apart under load), so the
test suite asserts only what load cannot change (tests/emulate/test_emulate.py); this measures the gap.

    python bench/bench_collective_roles.py --mbit 50 --mbytes 1 --out roles.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_link import run_on_two_ranks  # noqa: E402

RANK = textwrap.dedent("""
    import json, os, torch, torch.distributed as dist
    from galaxy.core.comm import Communicator
    from galaxy.core.context import import_world_binders
    from galaxy.planner.cluster import OPS
    from galaxy.planner.profile import measure_group
    import_world_binders()  # else the first functional collective binds WORLD past destroy: an abort at exit
    dist.init_process_group("gloo")
    comm = Communicator("probe", dist.get_rank(), dist.get_world_size())
    nbytes = int(os.environ["NBYTES"])
    last, waited = measure_group(comm, torch.device("cpu"), {op: [nbytes] for op in OPS}, reps=int(os.environ["REPS"]))
    if dist.get_rank() == 0:
        with open(os.environ["RESULT"], "w") as f:
            json.dump({op: [last[op](nbytes).item(), waited[op](nbytes).item()] for op in last}, f)
    dist.destroy_process_group()
""")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mbit", type=float, default=50.0, help="the links' rate (Mbit/s)")
    p.add_argument("--mbytes", type=float, default=1.048576, help="MB per collective (default 1 MiB)")
    p.add_argument("--reps", type=int, default=5, help="rounds (the median is reported)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    times, why = run_on_two_ranks(RANK, args.mbit, {"NBYTES": str(int(args.mbytes * 1e6)), "REPS": str(args.reps)})
    if times is None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    out = {"link_mbit": args.mbit, "mbytes": args.mbytes, "reps": args.reps, "load_1min": os.getloadavg()[0],
           "ops": {op: {"last_s": last, "waited_s": waited, "last_over_waited": last / waited if waited else None,
                        "gap": (last - waited) / last} for op, (last, waited) in times.items()}}
    print(f"{args.mbytes:g} MB over a {args.mbit:g} Mbit link, median of {args.reps} rounds "
          f"(1-min load {out['load_1min']:.1f}):")
    for op, row in out["ops"].items():
        ratio = "n/a" if row["last_over_waited"] is None else f"{row['last_over_waited']:.2f}x"
        print(f"  {op:15s} last {row['last_s'] * 1e3:7.1f} ms  waited {row['waited_s'] * 1e3:7.1f} ms  {ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
