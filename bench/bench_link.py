"""How close an emulated link comes to its configured rate, as Gloo sees it.

Two ranks on an emulated cluster (``galaxy.emulate``, a core each) whose links are shaped to
``--mbit``; rank 0 sends ``--mbytes`` to rank 1 over Gloo ``--reps`` times. Reported: the MB/s rank 1
measured (median, and each), and its ratio to the link's rate in MB/s. TCP/IP headers take ~4%, so a
quiet machine gives ~0.96; a busy one less (the ranks are not sent data as fast as the link allows).
The test suite checks only what load cannot change: no transfer beats the link
(tests/emulate/test_emulate.py); this measures how near it comes.

    python bench/bench_link.py --mbit 50 --mbytes 4 --out link.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from galaxy.emulate import Cluster, missing_prerequisite, run_emulated  # noqa: E402

RANK = textwrap.dedent("""
    import json, os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    payload = torch.zeros(int(os.environ["NBYTES"]) // 4)
    rates = []
    for _ in range(int(os.environ["REPS"])):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(payload, 1)
        else:
            dist.recv(payload, 0)
            rates.append(payload.numel() * 4 / (time.perf_counter() - start) / 1e6)
    if rank == 1:
        with open(os.environ["RESULT"], "w") as f:
            json.dump(rates, f)
    dist.barrier()
    dist.destroy_process_group()
""")


def run_on_two_ranks(rank_script: str, mbit: float, env: dict) -> tuple[object, str]:
    """``rank_script`` as both ranks of an emulated cluster (a core each, links shaped to ``mbit``); returns
    what a rank wrote to the JSON file named by $RESULT, or None and one line saying why there is none."""
    missing = missing_prerequisite()
    if missing:
        return None, missing
    cluster = Cluster.from_dict({"ranks": [{"compute_share": 1.0}] * 2, "links": {"bandwidth_mbit": mbit}})
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "rank.py"), os.path.join(tmp, "result.json")
        with open(script, "w") as f:
            f.write(rank_script)
        code = run_emulated(cluster, lambda rank: [sys.executable, script],
                            {**os.environ, "PYTHONPATH": ROOT, **env, "RESULT": result})
        if code:
            return None, f"the emulated ranks failed (exit code {code})"
        with open(result) as f:
            return json.load(f), ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mbit", type=float, default=50.0, help="the links' rate (Mbit/s)")
    p.add_argument("--mbytes", type=float, default=4.0, help="MB per transfer")
    p.add_argument("--reps", type=int, default=5, help="transfers")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    rates, why = run_on_two_ranks(RANK, args.mbit, {"NBYTES": str(int(args.mbytes * 1e6)), "REPS": str(args.reps)})
    if rates is None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    link = args.mbit / 8
    median = statistics.median(rates)
    out = {"link_mbit": args.mbit, "link_mb_per_s": link, "mbytes": args.mbytes, "mb_per_s": rates,
           "median_mb_per_s": median, "ratio": median / link, "load_1min": os.getloadavg()[0]}
    print(f"{args.mbytes:g} MB over a {args.mbit:g} Mbit link: {median:.2f} MB/s median of {len(rates)} "
          f"({median / link:.2f} of the link's {link:.2f} MB/s; 1-min load {out['load_1min']:.1f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
