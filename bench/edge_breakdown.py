"""Where one plan's batch-1 forward goes, per rank, on a scenario of ``bench_edge.py``: measured
compute and time inside collectives (waiting for peers included), next to the cost model's.

It rebuilds the scenario's emulated cluster (its shares and link) and its model, runs the plan there
(``--reps`` forwards after ``--warmup``, each behind a barrier, every collective timed through
``galaxy.core.comm``'s observers) and predicts the same plan from the cluster profile the scenario
measured (kept in its JSON).

    python bench/edge_breakdown.py docs/results/edge_llama.json --scenario 1 --methods SP/SP/SP --seq 45,83
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rank_main(config: str, out_dir: str, warmup: int, reps: int) -> None:
    """One emulated rank: median forward, collective and compute milliseconds, written to
    ``out_dir/rank<r>.json`` (ranks sharing one stdout pipe can interleave a long line), with the last
    forward's collectives (op, bytes, enter and leave on the host's monotonic clock)."""
    import torch
    import torch.distributed as dist

    from galaxy.config import GalaxyConfig
    from galaxy.core.context import ParallelContext
    from galaxy.models import build_model

    cfg = GalaxyConfig.from_file(config)
    ctx = ParallelContext.initialize(cfg.distributed, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "cpu")
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx).eval()
    records = []  # (leave time, record)
    ctx.mp.observers.append(lambda record: records.append((time.perf_counter(), record)))
    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_length), generator=torch.Generator().manual_seed(0))
    total, inside = [], []
    for i in range(warmup + reps):
        dist.barrier()
        records.clear()
        start = time.perf_counter()
        with torch.no_grad():
            model(ids)
        if i >= warmup:
            total.append(time.perf_counter() - start)
            inside.append(sum(r.seconds for _, r in records))
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    trace = [{"op": r.op, "bytes": r.nbytes, "enter_s": t - r.seconds, "leave_s": t} for t, r in records]
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"rank": ctx.rank, "total_ms": ms(total), "collectives_ms": ms(inside),
                   "compute_ms": ms([t - c for t, c in zip(total, inside)]), "start_s": start,
                   "last_forward": trace}, f)
    ctx.shutdown()


def predicted(profile: dict, cfg, methods: tuple, splits) -> list[dict]:
    """The cost model's forward, per rank: its compute and the rest (collectives and waits)."""
    import numpy as np

    from galaxy.planner.cluster import cluster_from_dict
    from galaxy.planner.group import Segments
    from galaxy.planner.simulate import predict
    from galaxy.planner.workload import Workload

    segments = Segments()
    work = Workload(cfg.model, "latency", cfg.train.global_batch_size, cfg.train.seq_length, cfg.train.dtype)
    total = float(predict(cluster_from_dict(profile), work, methods, splits, segments=segments).time_s[0])
    compute = np.sum([part[0] for part in segments.parts], axis=0)
    return [{"rank": r, "total_ms": round(total * 1e3, 3), "collectives_ms": round((total - c) * 1e3, 3),
             "compute_ms": round(float(c) * 1e3, 3)} for r, c in enumerate(compute)]


def print_trace(measured: list[dict]) -> None:
    """Each collective of the last forward side by side: when each rank entered and left it."""
    origin = min(m["start_s"] for m in measured)
    at = lambda t: f"{(t - origin) * 1e3:7.1f}"  # noqa: E731
    print("  collective          bytes  " + "  ".join(f"rank {m['rank']} enter/leave ms" for m in measured))
    for calls in zip(*(m["last_forward"] for m in measured)):
        print(f"  {calls[0]['op']:<16}{calls[0]['bytes']:>9}  "
              + "  ".join(f"  {at(c['enter_s'])} {at(c['leave_s'])}   " for c in calls))


def per_rank(text: str) -> list[int]:
    """'3,5' -> [3, 5] (argparse turns the ValueError into one line naming the flag)."""
    return [int(x) for x in text.split(",")]


def main() -> int:
    if sys.argv[1:2] == ["--rank"]:
        from galaxy.emulate.slowdown import slowdown_from_env, slowed_compute  # as the CLIs' ranks do

        with slowed_compute(slowdown_from_env()):
            rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    from bench_edge import ENV, cluster_file  # the scenario's cluster, built as bench_edge built it
    from galaxy.config import ConfigError, GalaxyConfig
    from galaxy.planner.workload import Splits

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a bench_edge.py JSON")
    p.add_argument("--scenario", type=int, default=0, help="index of the scenario in it")
    p.add_argument("--methods", required=True, help="ATT/CON/MLP, e.g. SP/SP/SP or TP/SP/TP")
    p.add_argument("--heads", type=per_rank, default=None, help="query heads per rank (ATT TP), e.g. 3,5")
    p.add_argument("--ffn", type=per_rank, default=None, help="FFN columns per rank (MLP TP)")
    p.add_argument("--seq", type=per_rank, default=None, help="tokens per rank (SP)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--trace", action="store_true",
                   help="also print the last forward's collectives per rank: enter and leave, ms from its start")
    args = p.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    scenarios, scenario_period_us = result["scenarios"], result["args"].get("cpu_period_us")
    if not 0 <= args.scenario < len(scenarios):
        p.error(f"--scenario must be 0..{len(scenarios) - 1}: '{args.result}' has {len(scenarios)} scenarios")
    s = scenarios[args.scenario]
    if "profile" not in s:
        p.error(f"scenario {args.scenario} of '{args.result}' kept no cluster profile (its profiling failed)")
    names = args.methods.split("/")
    if len(names) != 3:
        p.error(f"--methods '{args.methods}': give ATT/CON/MLP, e.g. SP/SP/SP")
    world = len(s["cores"])
    lists = {"tp_num_attention_heads_list": args.heads, "tp_intermediate_size_list": args.ffn,
             "seq_scatter_list": args.seq}
    parallel = {"att_parallel_method": names[0], "con_parallel_method": names[1], "mlp_parallel_method": names[2],
                **{k: v for k, v in lists.items() if v}}
    raw = {**s["config"], "parallel": parallel, "train": {**s["config"]["train"], "device": "cpu"}}
    try:
        cfg = GalaxyConfig.from_dict(raw)
        plan = cfg.resolve_plan(world)
    except ConfigError as e:
        p.error(str(e))
    methods = (plan.att, plan.con, plan.mlp)
    splits = Splits.one(plan.heads_split, plan.ffn_split, plan.seq_split)
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "plan.json")
        with open(config, "w") as f:
            json.dump(raw, f)
        cluster = cluster_file(os.path.join(tmp, "cluster.json"), s["cores"], s["link_mbit"],
                               scenario_period_us, result["args"].get("cpu_emulation", "cores"))
        run = subprocess.run([sys.executable, "-m", "galaxy.emulate", cluster, "--log-level", "WARNING", "--",
                              sys.executable, os.path.abspath(__file__), "--rank", config, tmp,
                              str(args.warmup), str(args.reps)], capture_output=True, text=True, cwd=ROOT, env=ENV)
        if run.returncode != 0:
            said = run.stderr.strip().splitlines()
            print(said[-1] if said else f"exit {run.returncode}", file=sys.stderr)
            return 1
        measured = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                measured.append(json.load(f))
    model = predicted(s["profile"], cfg, methods, splits)
    print(f"{s['model']} {':'.join(map(str, s['shares']))} at {s['link_mbit']:g} Mbit, {args.methods} "
          f"heads {list(plan.heads_split)} ffn {list(plan.ffn_split)} seq {list(plan.seq_split)}; ms, measured (predicted)")
    for m, q in zip(measured, model):
        print(f"  rank {m['rank']} ({s['cores'][m['rank']]:g} cores): forward {m['total_ms']:.1f} "
              f"({q['total_ms']:.1f}), compute {m['compute_ms']:.1f} ({q['compute_ms']:.1f}), "
              f"in collectives {m['collectives_ms']:.1f} ({q['collectives_ms']:.1f})")
    if args.trace:
        print_trace(measured)
    print(json.dumps({"measured": measured, "predicted": model}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
