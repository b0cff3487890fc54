"""How slow an emulated compute share really is, piece by piece.

A rank of ``--share`` cores (``galaxy.emulate``, each ``cpu_emulation`` mode) computes pieces of a
fixed amount of work (128 x 128 matmuls on one thread, ``--pieces`` ms each on a free core; under
"dilate" the rank stretches them as Galaxy's CLIs do) separated by sleeps of
``--waits`` ms, as a rank does between collectives. Reported per (piece, wait): the mean seconds of a
piece in the emulated rank over the same on a free core (pinned to ``--free_cpu``); a faithful slower
device gives 1 / share everywhere. The planner's profile times blocks back to back, so wherever this
ratio departs from 1 / share after waits, plans that compute in such pieces are mispredicted.

    python bench/bench_share.py --out docs/results/share_pieces.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from galaxy.emulate import Cluster, EmulatedCluster  # noqa: E402

SIZE = 128  # one matmul ~0.05 ms: pieces of 0.5 ms are ten ops

# argv[1]: JSON [[matmuls, repetitions, wait s], ...]; prints the mean seconds of each
PIECES = """
import json, statistics, sys, time
import torch
from galaxy.emulate.slowdown import slowdown_from_env, slowed_compute
torch.set_num_threads(1)
a = torch.randn(SIZE, SIZE)
means = []
with slowed_compute(slowdown_from_env()):
    for _ in range(50):  # first calls (the dispatch mode's included) are slow
        torch.mm(a, a)
    for n, reps, wait in json.loads(sys.argv[1]):
        took = []
        for _ in range(reps):
            if wait > 0:
                time.sleep(wait)
            t = time.perf_counter()
            for i in range(n):
                torch.mm(a, a)
            took.append(time.perf_counter() - t)
        means.append(statistics.mean(took))
print(json.dumps(means))
""".replace("SIZE", str(SIZE))


def seconds_per_matmul() -> float:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(SIZE, SIZE)
    for _ in range(50):
        torch.mm(a, a)
    t = time.perf_counter()
    for _ in range(500):
        torch.mm(a, a)
    return (time.perf_counter() - t) / 500


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, default=0.5, help="the emulated rank's compute_share (cores)")
    p.add_argument("--modes", default="cores,dilate,quota", help="cpu_emulation modes to measure")
    p.add_argument("--cpu_period_us", type=int, default=2000, help="CFS period of the quota mode")
    p.add_argument("--pieces", default="0.5,1,2,5,20", help="ms of work per piece on a free core")
    p.add_argument("--waits", default="0,1,5", help="ms of sleep before each piece")
    p.add_argument("--seconds", type=float, default=1.0, help="about this long per (piece, wait) and side")
    p.add_argument("--free_cpu", type=int, default=1, help="the free core the baseline is pinned to")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    per = seconds_per_matmul()
    pieces = [float(x) for x in args.pieces.split(",")]
    waits = [float(x) for x in args.waits.split(",")]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "host": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, {platform.release()}",
               "args": vars(args), "modes": {}}
    grid = [(piece, wait) for piece in pieces for wait in waits]
    runs = json.dumps([[max(1, round(piece / 1e3 / per)),
                        max(10, int(args.seconds / ((piece / args.share + wait) / 1e3))), wait / 1e3]
                       for piece, wait in grid])
    argv = [sys.executable, "-c", PIECES, runs]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    for mode in args.modes.split(","):
        cluster = Cluster.from_dict({"ranks": [{"compute_share": args.share}], "cpu_emulation": mode,
                                     "cpu_period_us": args.cpu_period_us})
        free = json.loads(subprocess.run(["taskset", "-c", str(args.free_cpu), *argv], capture_output=True,
                                         text=True, check=True, env=env).stdout)
        with EmulatedCluster(cluster) as emu:
            emulated = json.loads(emu.spawn(0, argv, env, stdout=subprocess.PIPE, text=True).communicate()[0])
        rows = [{"piece_ms": piece, "wait_ms": wait, "free_ms": round(f * 1e3, 3), "emulated_ms": round(e * 1e3, 3),
                 "ratio": round(e / f, 3)} for (piece, wait), f, e in zip(grid, free, emulated)]
        for r in rows:
            print(f"{mode:6s} piece {r['piece_ms']:5g} ms after {r['wait_ms']:3g} ms waits: {r['ratio']:.2f}x "
                  f"(faithful: {1 / args.share:.2f}x)", flush=True)
        results["modes"][mode] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print("median ratio per mode:", {m: statistics.median(r["ratio"] for r in rows)
                                     for m, rows in results["modes"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
