"""The Galaxy paper's table on emulated edge clusters: single-request latency and training step time
of every plan, and of the plan the planner picks, on a few slow devices joined by slow links.

    python bench/bench_edge.py                                  # the default scenarios (CPU, root)
    python bench/bench_edge.py --models bert --shares 1:2 --links 100 --layers 2
    python bench/bench_edge.py --quick                          # one tiny scenario, a smoke test

A scenario is a model, the ranks' compute shares (``1:2``: rank 1 has twice rank 0's share of a
core, ``--core_unit`` cores per share unit) and one link bandwidth for every rank (Mbit/s), built by
``galaxy.emulate`` (network namespaces, tbf-shaped links, ``--cpu_emulation``: by default every rank
on a core of its own, a slower one stretching each op to its share). In each
scenario, in one run of this script:

1. the planner's profiler measures the emulated cluster from inside it (``python -m galaxy.emulate
   cluster.json -- plan_galaxy.py profile``), and ``plan_galaxy.py --validate K --emulate`` searches a
   plan per objective (``latency``: a batch-1 forward; ``train``: a whole training step) and runs its
   top K plans on the cluster; the first is ``planned``;
2. every other contender runs on the same emulated cluster: ``alone`` (one rank with the fastest
   device's share), ``tp``, ``sp``, ``galaxy``, ``galaxy2`` with even splits. Latency:
   ``infer_galaxy.py`` (median over repetitions of the slowest rank's batch-1 forward; LLaMA also
   greedy generation with the KV cache); training: ``pretrain_galaxy.py`` (BERT MLM, median step
   time after the first) — LLaMA is timed for latency only;
3. the cost model's prediction is recorded beside each measurement (even-split plans and the serial
   model alone through ``galaxy.planner.simulate.predict`` on the same profile).

Raw JSON goes to ``--out/edge_<model>.json`` (every measurement, prediction, the planner's table and
the host's load average at the start and end of each scenario), PNG plots beside it, and a markdown
table to stdout. Root, iproute2 and cgroup v1 cpu are needed (``galaxy.emulate``).
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
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from galaxy.config import PLAN_PRESETS, GalaxyConfig  # noqa: E402
from galaxy.emulate.cluster import CPU_EMULATIONS  # noqa: E402

# Every command, the profiler's included: PyTorch's CPU allocator asks for huge pages for large
# tensors, which made a serial BERT-large step 6% faster and its run-to-run spread 3% instead of 10%.
ENV = dict(os.environ, PYTHONPATH=ROOT, THP_MEM_ALLOC_ENABLE="1")
EVEN = ("tp", "sp", "galaxy", "galaxy2")
CONTENDERS = ("alone",) + EVEN + ("planned",)
MODELS = {
    # BERT-base shape (hidden 768, 12 heads, FFN 3072); --layers trims the stack to fit the time.
    "bert": {"preset": "bert-base"},
    "bert-large": {"preset": "bert-large"},
    # A small LLaMA: GQA (8 query heads on 4 key/value heads), SwiGLU.
    "llama": {"preset": "llama-tiny", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 1408, "vocab_size": 8192, "max_position_embeddings": 1024},
}
QUICK = {"bert": {"preset": "bert-tiny", "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4}}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="bert,llama", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--shares", default="1:1,1:2,1:1:2", help="compute shares per scenario, e.g. 1:2,1:1:2")
    p.add_argument("--links", default="50,100,500,1000", help="link bandwidths in Mbit/s")
    p.add_argument("--core_unit", type=float, default=0.5, help="CPU cores per share unit (1:2 -> 0.5 and 1.0 cores)")
    p.add_argument("--cpu_emulation", default="dilate", choices=CPU_EMULATIONS,
                   help="how a share is made slower (galaxy/emulate/cluster.py): 'dilate' needs a core per rank")
    p.add_argument("--cpu_period_us", type=int, default=None,
                   help="the CPU quota's CFS period (the cluster file's key; default: the emulator's)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (the presets' own: 0)")
    p.add_argument("--vocab_size", type=int, default=8192, help="BERT vocabulary (0: the preset's 30522)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (the request's prompt)")
    p.add_argument("--batch", type=int, default=2, help="rows per training step")
    p.add_argument("--objectives", default="latency,train", help="latency, train or both")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="which to run")
    p.add_argument("--generate", type=int, default=8, help="LLaMA: greedy tokens per timed generation (0: none)")
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards before the timed ones")
    p.add_argument("--reps", type=int, default=7, help="timed forwards per contender")
    p.add_argument("--steps", type=int, default=4, help="training steps per contender (the first is not timed)")
    p.add_argument("--profile_reps", type=int, default=3, help="repetitions per profiler measurement")
    p.add_argument("--validate", type=int, default=3,
                   help="the planner's top plans run on the cluster (plan_galaxy.py --validate; the first is 'planned')")
    p.add_argument("--validate_runs", type=int, default=2, help="launches per validated plan (their mean)")
    p.add_argument("--window_ms", type=float, default=200.0,
                   help="the profiler averages each timing over this long (two periods of the CPU quota)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results"), help="JSON and PNG go here")
    p.add_argument("--tag", default="", help="appended to the output names (edge_<model><tag>.json)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launched command")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: one tiny BERT, 1:2 shares at 1000 Mbit, latency of alone, tp and planned")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON",
                   help="print the markdown table of earlier runs' edge_*.json and exit")
    args = p.parse_args()
    if args.quick:
        args.models, args.shares, args.links, args.objectives = "bert", "1:2", "1000", "latency"
        args.contenders = "alone,tp,planned"
        args.layers, args.seq, args.batch, args.reps, args.warmup, args.profile_reps = 1, 16, 2, 2, 1, 1
        args.validate, args.validate_runs = 1, 1
        args.window_ms = 0.0
    return args


# ----------------------------------------------------------------------------- commands


def launch(argv: list[str], timeout: int) -> Optional[subprocess.CompletedProcess]:
    """Run one command from the repository root; None (the error printed) when it fails."""
    started = time.perf_counter()
    try:
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout}s: {' '.join(argv[:8])} ...", file=sys.stderr)
        return None
    if out.returncode != 0:
        print(f"  failed ({out.returncode}): {' '.join(argv)}\n{out.stderr[-1500:]}", file=sys.stderr)
        return None
    shown = argv[argv.index("--") + 2:] if "--" in argv else argv[1:]  # a rank's command, on a cluster
    print(f"  {time.perf_counter() - started:6.1f}s  {' '.join(shown[:5])} ...", file=sys.stderr, flush=True)
    return out


def model_config(args, model: str) -> dict:
    fields = dict((QUICK if args.quick else MODELS)[model])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    if model.startswith("bert") and args.vocab_size:
        fields["vocab_size"] = args.vocab_size
    return {"model": fields, "train": {"seq_length": args.seq, "global_batch_size": args.batch, "lr": 1e-4,
                                       "warmup_steps": 0, "log_every": 10**6}}


def cluster_file(path: str, shares: list[float], link: float, period_us: Optional[int], emulation: str) -> str:
    raw = {"ranks": [{"compute_share": s} for s in shares], "links": {"bandwidth_mbit": link},
           "cpu_emulation": emulation}
    if period_us is not None:
        raw["cpu_period_us"] = period_us
    with open(path, "w") as f:
        json.dump(raw, f)
    return path


def load_average() -> list[float]:
    return list(os.getloadavg())


# ----------------------------------------------------------------------------- one scenario


def profile_and_plan(work: str, cfg_path: str, cluster: str, objectives: list[str], args) -> dict:
    """The planner on this emulated cluster: the profile, and per objective the written plan, its
    table and the top ``--validate`` plans run on the cluster (``plan_galaxy.py --validate``)."""
    prof = os.path.join(work, "profile.json")
    out = launch(on_cluster(cluster, ["plan_galaxy.py", "profile", "--model", cfg_path, "--rows", "1", str(args.batch),
                                      "--reps", str(args.profile_reps), "--window_ms", str(args.window_ms), "--out",
                                      prof]), args.timeout)
    if out is None:
        return {}
    plans = {"profile": prof}
    for objective in objectives:
        path = os.path.join(work, f"plan_{objective}.json")
        steps = args.reps if objective == "latency" else args.steps
        if launch([sys.executable, "plan_galaxy.py", "--model", cfg_path, "--cluster", prof, "--objective", objective,
                   "--out", path, "--top", "12", "--validate", str(args.validate), "--validate_steps", str(steps),
                   "--validate_runs", str(args.validate_runs), "--emulate", cluster],
                  args.timeout * max(1, args.validate * args.validate_runs)) is None:
            continue
        with open(os.path.splitext(path)[0] + ".plans.json") as f:
            plans[objective] = {"config": path, "table": json.load(f)["plans"]}
    return plans


def predict_even(profile: str, cfg: GalaxyConfig, objective: str, plan: str, mp: int) -> Optional[float]:
    """The cost model's milliseconds for an even-split preset plan on the profiled cluster."""
    from galaxy.planner.cluster import load_cluster
    from galaxy.planner.simulate import predict
    from galaxy.planner.workload import Splits

    try:
        pred = predict(load_cluster(profile), workload(cfg, objective), PLAN_PRESETS[plan],
                       Splits.balanced(cfg.model, cfg.train.seq_length, mp))
    except (ValueError, KeyError) as e:  # a split the profile has no measurement for
        print(f"  no prediction for {plan}: {e}", file=sys.stderr)
        return None
    return round(float(pred.time_s[0]) * 1e3, 3)


def predict_alone(profile: str, cfg: GalaxyConfig, objective: str) -> float:
    """The cost model's milliseconds for the serial model on the device it predicts fastest."""
    from galaxy.planner.cluster import load_cluster
    from galaxy.planner.simulate import predict
    from galaxy.planner.workload import Splits

    cluster = load_cluster(profile)
    serial = Splits.balanced(cfg.model, cfg.train.seq_length, 1)
    return round(min(float(predict(cluster.restrict([d]), workload(cfg, objective), PLAN_PRESETS["none"],
                                   serial).time_s[0]) for d in range(cluster.world)) * 1e3, 3)


def workload(cfg: GalaxyConfig, objective: str):
    from galaxy.planner.workload import Workload

    return Workload(cfg.model, objective, cfg.train.global_batch_size, cfg.train.seq_length, cfg.train.dtype,
                    cfg.train.optimizer)


def contender_flags(name: str, cfg_path: str) -> list[str]:
    return ["--config", cfg_path, "--override", f"plan={'none' if name == 'alone' else name}"]


def planned_row(top: dict, objective: str) -> dict:
    """The planner's pick as its validation run measured it (the same CLI and repetitions)."""
    measured = top["measured_ms"]
    return {"measured": {"forward": {"median_ms": measured}} if objective == "latency" else {"median_ms": measured},
            "predicted_ms": top["predicted_ms"], "plan": top["plan"], "layout": top["dp x pp x mp"],
            "devices": top["devices"], "splits": {k: top[k] for k in ("heads", "ffn", "seq")}}


def on_cluster(cluster: str, argv: list[str]) -> list[str]:
    """``argv`` as every rank of ``cluster``: the same ranks as the CLI's ``--emulate`` starts (its command without
    that flag, through galaxy.emulate's ``run_emulated``), from galaxy.emulate's own launcher, which imports no torch
    (the CLI's imports Galaxy's model code first: seconds of CPU per contender)."""
    return [sys.executable, "-m", "galaxy.emulate", cluster, "--log-level", "WARNING", "--", sys.executable, *argv]


def measure_latency(name: str, cluster: str, flags: list[str], work: str, args, is_llama: bool) -> Optional[dict]:
    summary = os.path.join(work, f"latency_{name}.json")
    argv = on_cluster(cluster, ["infer_galaxy.py", *flags, "--warmup", str(args.warmup), "--reps", str(args.reps),
                                "--summary_json", summary])
    if is_llama and args.generate:
        argv += ["--generate", str(args.generate)]
    if launch(argv, args.timeout) is None:
        return None
    with open(summary) as f:
        return json.load(f)


def measure_train(name: str, cluster: str, flags: list[str], work: str, args) -> Optional[dict]:
    metrics = os.path.join(work, f"train_{name}.jsonl")
    argv = on_cluster(cluster, ["pretrain_galaxy.py", *flags, "--max_steps", str(args.steps), "--metrics_file",
                                metrics, "--no_progress"])
    if launch(argv, args.timeout) is None:
        return None
    with open(metrics) as f:
        steps = [json.loads(line)["step_time_s"] * 1e3 for line in f][1:]
    return {"median_ms": round(statistics.median(steps), 3), "min_ms": round(min(steps), 3),
            "max_ms": round(max(steps), 3), "all_ms": [round(s, 3) for s in steps]}


def run_scenario(model: str, shares: list[int], link: float, args, objectives: list[str]) -> dict:
    name = f"{model} {':'.join(map(str, shares))} {link:g}Mbit"
    print(f"== {name}", file=sys.stderr, flush=True)
    result = {"model": model, "shares": shares, "cores": [s * args.core_unit for s in shares], "link_mbit": link,
              "cpu_emulation": args.cpu_emulation,
              "load_before": load_average(), "latency": {}, "train": {}}
    if model.startswith("llama"):  # LLaMA's training CLI needs instruction data of uneven lengths: latency only
        objectives = [o for o in objectives if o == "latency"]
    with tempfile.TemporaryDirectory(prefix="bench_edge_") as work:
        raw = model_config(args, model)
        cfg_path = os.path.join(work, "model.json")
        with open(cfg_path, "w") as f:
            json.dump(raw, f)
        cfg = GalaxyConfig.from_dict(raw)
        result["config"] = raw
        cluster = cluster_file(os.path.join(work, "cluster.json"), result["cores"], link, args.cpu_period_us,
                               args.cpu_emulation)
        alone = cluster_file(os.path.join(work, "alone.json"), [max(result["cores"])], link, args.cpu_period_us,
                             args.cpu_emulation)
        wanted = args.contenders.split(",")
        plans = profile_and_plan(work, cfg_path, cluster, objectives, args) if "planned" in wanted else {}
        if "profile" in plans:  # kept, so the cost model can be checked against this run again
            with open(plans["profile"]) as f:
                result["profile"] = json.load(f)
        for objective in objectives:
            if objective in plans:
                result[objective]["planner_table"] = plans[objective]["table"]
            rows = {}
            for contender in wanted:
                if contender == "planned":
                    if objective in plans and plans[objective]["table"][0].get("measured_ms") is not None:
                        rows[contender] = planned_row(plans[objective]["table"][0], objective)
                    continue
                flags = contender_flags(contender, cfg_path)
                where = alone if contender == "alone" else cluster
                if objective == "latency":
                    measured = measure_latency(contender, where, flags, work, args, model.startswith("llama"))
                else:
                    measured = measure_train(contender, where, flags, work, args)
                row = {"measured": measured}
                if contender in EVEN and "profile" in plans:
                    row["predicted_ms"] = predict_even(plans["profile"], cfg, objective, contender, len(shares))
                if contender == "alone" and "profile" in plans:
                    row["predicted_ms"] = predict_alone(plans["profile"], cfg, objective)
                rows[contender] = row
            result[objective]["contenders"] = rows
            result[objective]["verdict"] = verdict(result, objective)
    result["load_after"] = load_average()
    return result


def median_of(row: dict, objective: str) -> Optional[float]:
    m = row.get("measured")
    if not m:
        return None
    return m["forward"]["median_ms"] if objective == "latency" else m["median_ms"]


def verdict(scenario: dict, objective: str) -> dict:
    """What the issue asks of a scenario: the planned plan against the best even split and even TP,
    the planner's pick against the fastest measured plan (validated plans included), and the
    prediction error of every contender and of every validated plan. A pick of the fastest device
    alone is the ``alone`` contender's configuration: the two are one plan measured twice (their gap
    is this machine's run-to-run noise, kept as ``alone_vs_planned``), not a faster plan."""
    rows = scenario[objective]["contenders"]
    table = scenario[objective].get("planner_table", [])
    times = {k: median_of(r, objective) for k, r in rows.items()}
    times = {k: v for k, v in times.items() if v is not None}
    out = {"fastest": min(times, key=times.get) if times else None}
    even = {k: times[k] for k in EVEN if k in times}
    planned = times.get("planned")
    if planned and even:
        best = min(even, key=even.get)
        out.update(best_even=best, planned_vs_best_even=round(even[best] / planned, 3))
    if planned and "tp" in times:
        out["planned_vs_tp"] = round(times["tp"] / planned, 3)
    validated = [r for r in table if r.get("measured_ms") is not None]
    pick = rows.get("planned", {})
    shares = scenario["shares"]
    if pick.get("plan") == "none" and len(pick.get("devices") or []) == 1 and shares[pick["devices"][0]] == max(shares):
        out["planned_is_alone"] = True
        if "alone" in times and planned:
            out["alone_vs_planned"] = round(times.pop("alone") / planned, 3)
    if planned:
        out["planned_vs_fastest"] = round(planned / min([*times.values(), *(r["measured_ms"] for r in validated)]), 3)
    errors = {k: round(r["predicted_ms"] / times[k] - 1, 3) for k, r in rows.items()
              if r.get("predicted_ms") and k in times}
    if errors:
        out["prediction_error"] = errors
    if validated:
        out["validation_error"] = [round(r["predicted_ms"] / r["measured_ms"] - 1, 3) for r in validated]
    return out


def accuracy(results: list[dict]) -> str:
    """The issue's three questions over the whole table, for people."""
    validated, every, picks = [], [], []
    for r in results:
        for objective in ("latency", "train"):
            if not r[objective].get("contenders"):
                continue
            v = verdict(r, objective)
            validated += v.get("validation_error", [])
            every += [e for k, e in v.get("prediction_error", {}).items() if k != "planned"]
            every += v.get("validation_error", [])
            if "planned_vs_fastest" in v:
                picks.append(v["planned_vs_fastest"])

    def spread(errors):
        if not errors:
            return "-"
        a = [abs(e) * 100 for e in errors]
        return f"median {statistics.median(a):.1f}%, worst {max(a):.1f}% over {len(a)}"

    return (f"prediction error, validated plans: {spread(validated)}; every measured plan: {spread(every)}; "
            f"the pick within 5% of the fastest measured in {sum(p <= 1.05 for p in picks)} of {len(picks)} rows")


# ----------------------------------------------------------------------------- output


def markdown(results: list[dict]) -> str:
    lines = ["| model | shares | cpu | link Mbit | objective | " + " | ".join(CONTENDERS) + " | planned plan | "
             "planned vs best even | planned vs TP |",
             "|---" * (len(CONTENDERS) + 8) + "|"]
    for r in results:
        for objective in ("latency", "train"):
            rows = r[objective].get("contenders")
            if not rows:
                continue
            cells = []
            for c in CONTENDERS:
                t = median_of(rows[c], objective) if c in rows else None
                pred = rows.get(c, {}).get("predicted_ms")
                cells.append("-" if t is None else f"{t:.1f}" + (f" ({pred:.0f})" if pred else ""))
            v, planned = verdict(r, objective), rows.get("planned", {})
            plan = planned.get("plan", "-") + (f" ({planned['layout']})" if planned.get("layout") else "")
            if planned.get("devices") is not None and len(planned["devices"]) < len(r["shares"]):
                plan += f" on device{'s' if len(planned['devices']) > 1 else ''} {planned['devices']}"
            if planned.get("splits"):
                plan += " " + " ".join(f"{k}={s}" for k, s in planned["splits"].items() if s)
            lines.append(f"| {r['model']} | {':'.join(map(str, r['shares']))} | {r.get('cpu_emulation', '-')} | "
                         f"{r['link_mbit']:g} | {objective} | "
                         + " | ".join(cells) + f" | {plan} | {v.get('planned_vs_best_even', '-')}x | "
                         f"{v.get('planned_vs_tp', '-')}x |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = [o for o in ("latency", "train") if any(r[o].get("contenders") for r in results)]
    fig, axes = plt.subplots(1, len(objectives), figsize=(7 * len(objectives), 4.5), squeeze=False)
    for ax, objective in zip(axes[0], objectives):
        scenarios = [r for r in results if r[objective].get("contenders")]
        width = 0.8 / len(CONTENDERS)
        for i, c in enumerate(CONTENDERS):
            ys = [median_of(r[objective]["contenders"].get(c, {}), objective) or 0 for r in scenarios]
            ax.bar([j + i * width for j in range(len(scenarios))], ys, width, label=c)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scenarios))])
        ax.set_xticklabels([f"{':'.join(map(str, r['shares']))}\n{r['link_mbit']:g} Mbit" for r in scenarios])
        ax.set_ylabel("batch-1 forward ms (median)" if objective == "latency" else "training step ms (median)")
        if objective == "train":
            ax.set_yscale("log")  # gradient syncs over slow links spread the plans over decades
        ax.set_title(f"{scenarios[0]['model']}: {objective}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse()
    if args.report:
        results = []
        for path in args.report:
            with open(path) as f:
                results += json.load(f)["scenarios"]
        print(markdown(results))
        print(accuracy(results))
        return 0
    from galaxy.emulate import missing_prerequisite

    missing = missing_prerequisite()
    if missing:
        print(f"error: emulation is unavailable here: {missing}", file=sys.stderr)
        return 2
    objectives = [o for o in args.objectives.split(",") if o]
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    all_results = []
    for model in args.models.split(","):
        results = []
        for shares in args.shares.split(","):
            for link in args.links.split(","):
                results.append(run_scenario(model, [int(s) for s in shares.split(":")], float(link), args, objectives))
                write(results, model, args, commit)
        all_results += results
    print(markdown(all_results))
    print(accuracy(all_results))
    return 0


def write(results: list[dict], model: str, args, commit: str) -> None:
    """After every scenario, so a run cut short keeps what it measured."""
    base = os.path.join(args.out, f"edge_{model}{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
                   "host": f"{os.cpu_count()} CPU cores, emulated (galaxy.emulate)", "args": vars(args),
                   "scenarios": results}, f, indent=2)
    plot(results, base + ".png")


if __name__ == "__main__":
    sys.exit(main())
