"""``plan_galaxy.py``: profile a cluster, then pick the best plan for it.

    plan_galaxy.py profile --model bert-base --world 4 --out cluster.json
    plan_galaxy.py --model bert-base --cluster cluster.json --objective train --out plan.json [--validate 3]

``--model`` is a preset name (each model family's ``presets``) or a config file, whose model and
train sections (seq_length, global_batch_size, dtype) set the workload; ``--override KEY=VALUE``
changes any key. The plan is written as a config the training CLIs take (``--config plan.json``),
the top plans as a table (printed, and as JSON beside it). ``--validate K`` runs the top K through
``pretrain_galaxy.py`` (masked- or causal-LM pretraining, as the model family trains) or, for
``--objective latency``, ``infer_galaxy.py``, prints the measured times beside the predicted, and writes
the fastest of them as the plan (the cost model ranks, the measurement picks: what a prediction leaves out,
the measurement sees). The search runs the config's ``dp_engine``; ``--dp_engines fsdp2`` (or others)
searches those too wherever dp > 1, and each plan's config names its engine. Plans whose ATT is SP are
priced in every SP attention flavour (``--sp_attentions``: allgather, ring, ulysses) and name the one chosen.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from galaxy.cli.args import add_launch_flags, model_flag_config, new_parser
from galaxy.cli.launch import interruptible, launch_ranks
from galaxy.cli.output import bad_input, check_output_path, setup_logging, stage
from galaxy.cli.run import Run, prepare, ranks_of
from galaxy.config import MODEL_PRESETS, SP_ATTENTIONS, ConfigError, GalaxyConfig, Method, ParallelConfig
from galaxy.errors import UserError
from galaxy.planner.cluster import ClusterProfile, load_cluster
from galaxy.planner.workload import Workload
from galaxy.planner.search import DEVICE_MARGIN, SPLIT_MARGIN, Choice, search

logger = logging.getLogger(__name__)

DESCRIPTION = "profile a cluster, then search the plans for it and write the config"
STEPS = """Two steps:
  1. {prog} profile --model M --world N --out cluster.json
     measures each rank's block times, memory and collectives (its flags: below, and {prog} profile --help)
  2. {prog} --model M --cluster cluster.json --out plan.json [--validate K]
     searches the plans of that cluster and writes the best as a config the training commands take"""


def model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(MODEL_PRESETS)}) or a JSON config file")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key (repeatable), e.g. vocab_size=512")
    p.add_argument("--seq_length", type=int, default=None, help="tokens per sequence (default: the config's)")
    p.add_argument("--global_batch_size", type=int, default=None, help="rows per step (default: the config's)")


def workload_config(args: argparse.Namespace) -> GalaxyConfig:
    return model_flag_config(args, None)


# ----------------------------------------------------------------------------- profile


def profile_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = new_parser(prog, "measure the ranks and links of a cluster (step 1 of the planner)")
    model_arguments(p)
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="batch sizes to measure the blocks at (the cost model interpolates between them); "
                        "default: 1 and the config's global_batch_size")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median)")
    p.add_argument("--window_ms", type=float, default=200.0,
                   help="each timing averages repeated runs over at least this long (CPU-quota periods; 0: one run)")
    p.add_argument("--memory_gb", type=float, default=None, help="memory budget per rank (default: measured)")
    p.add_argument("--ffn_unit", type=int, default=1, help="FFN shard sizes are measured in multiples of this")
    p.add_argument("--calibration_layers", type=int, default=None, metavar="N",
                   help="the whole serial training steps that calibrate the profile run a model of only N layers "
                        "(for a model whose serial step does not fit one device; the pieces are per layer)")
    p.add_argument("--sustain_s", type=float, default=20.0,
                   help="on GPUs: seconds of those serial steps back to back, every rank at once, whose slowdown "
                        "over the short runs (a card at its power limit clocks lower) scales every training "
                        "prediction (the cluster file's sustained_scale; 0: not measured)")
    p.add_argument("--out", required=True, help="cluster profile to write (JSON)")
    return add_launch_flags(p)


@dataclass(frozen=True)
class ClusterMeasurement:
    """What ``plan profile`` measures and where it writes it."""

    rows: tuple[int, ...]
    out: str
    reps: int = 5
    window_s: float = 0.2
    memory_gb: Optional[float] = None
    ffn_unit: int = 1
    calibration_layers: Optional[int] = None
    sustain_s: float = 20.0

    def __post_init__(self) -> None:
        if min(self.rows) < 1 or self.reps < 1 or self.window_s < 0 or self.sustain_s < 0:
            raise ConfigError("--rows and --reps must be at least 1, --window_ms and --sustain_s at least 0")
        if self.calibration_layers is not None and self.calibration_layers < 1:
            raise ConfigError(f"--calibration_layers must be at least 1, got {self.calibration_layers}")
        if self.ffn_unit < 1:
            raise ConfigError(f"--ffn_unit must be at least 1, got {self.ffn_unit}")


def cluster_profile_body(ctx, run: Run) -> None:
    from galaxy.planner.profile import profile_rank

    cfg, job = run.cfg, run.job
    if ctx.rank == 0:
        stage(f"profile: {cfg.model.model_type} of {cfg.model.num_hidden_layers} layers (hidden "
              f"{cfg.model.hidden_size}) on {ctx.world_size} rank(s), rows {list(job.rows)}, seq_length "
              f"{cfg.train.seq_length}")
    started = time.perf_counter()
    cluster = profile_rank(ctx, cfg.model, job.rows, cfg.train.seq_length, cfg.train.dtype, job.reps,
                           job.memory_gb, job.ffn_unit, window_s=job.window_s,
                           calibration_layers=job.calibration_layers, sustain_s=job.sustain_s)
    if cluster is not None:
        cluster.save(job.out)
        stage(f"profile: done in {time.perf_counter() - started:.1f}s")
        print(f"wrote {job.out}: {cluster.world} ranks, {len(cluster.groups)} groups", flush=True)


def profile_main(argv: list[str], prog: Optional[str] = None) -> int:
    args = profile_parser(prog).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = workload_config(args)
        job = ClusterMeasurement(tuple(args.rows or (1, cfg.train.global_batch_size)), args.out, args.reps,
                                 args.window_ms / 1e3, args.memory_gb, args.ffn_unit, args.calibration_layers,
                                 args.sustain_s)
        if cfg.model.intermediate_size % job.ffn_unit:
            raise ConfigError(f"--ffn_unit {job.ffn_unit} must be a positive divisor of intermediate_size "
                              f"{cfg.model.intermediate_size}")
        cfg.parallel = ParallelConfig()  # the workload is the model and train sections: every group is measured
        launch, run = prepare(args, cfg, plan="none", rank0_files={"out": job.out}, job=job)
    except (UserError, FileNotFoundError) as e:
        return bad_input(e)
    return launch_ranks(ranks_of(cluster_profile_body), launch, run, cfg)


# ----------------------------------------------------------------------------- plan


def plan_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    name = prog or os.path.basename(sys.argv[0])
    p = new_parser(prog, f"{DESCRIPTION}.\n\n{STEPS.format(prog=name)}\n\nThe flags of step 2:")
    p.epilog = f"The flags of step 1:\n\n{profile_parser(f'{name} profile').format_help()}"
    model_arguments(p)
    p.add_argument("--cluster", required=True, help="cluster profile from plan_galaxy.py profile")
    p.add_argument("--objective", choices=("train", "latency"), default="train",
                   help="train: step time; latency: one batch-1 forward")
    p.add_argument("--out", required=True, help="the chosen plan as a config JSON")
    p.add_argument("--table", default=None, help="the top plans as JSON (default: OUT with .plans.json)")
    p.add_argument("--top", type=int, default=10, help="plans in the table")
    p.add_argument("--ffn_unit", type=int, default=1, help="FFN splits in multiples of this")
    p.add_argument("--seq_unit", type=int, default=1, help="sequence splits in multiples of this")
    p.add_argument("--split_margin", type=float, default=SPLIT_MARGIN,
                   help="keep the even split unless an uneven one is predicted faster by more than this fraction "
                        "(equal devices' profiles differ by their noise; 0: the predicted optimum)")
    p.add_argument("--device_margin", type=float, default=DEVICE_MARGIN,
                   help="put a plan on more devices first only where it is predicted faster than the best plan on "
                        "fewer by more than this fraction (0: the predicted optimum)")
    p.add_argument("--dp_engines", nargs="+", default=[], metavar="ENGINE",
                   help="with dp > 1, also search these dp engines (ddp, zero1, deepspeed, fsdp2) beside the config's "
                        "dp_engine, e.g. --dp_engines fsdp2 (with and without resharding after forward, gradients "
                        "reduce-scattered every micro-batch or once); under fsdp2 mp_grad_reduce sharded or overlap "
                        "becomes after_backward, as the config requires")
    p.add_argument("--mp_grad_reduces", nargs="+", default=[], metavar="MODE",
                   help="with mp > 1, also search these reductions of PARTIAL gradients (after_backward, overlap, "
                        "sharded, fsdp) beside the config's mp_grad_reduce, each under the dp engines that run it "
                        "and for plans it acts on, e.g. --mp_grad_reduces sharded fsdp (fsdp: the SP blocks' "
                        "weights sharded over mp)")
    p.add_argument("--sp_attentions", nargs="+", default=list(SP_ATTENTIONS), metavar="FLAVOUR",
                   help="for plans whose ATT is SP, the attention flavours to price and choose from (allgather, ring, "
                        "ulysses; default all three; the config's sp_attention is always among them)")
    p.add_argument("--validate", type=int, default=0, metavar="K", help="run the top K plans and print measured times")
    p.add_argument("--validate_steps", type=int, default=5,
                   help="training steps (the run's steady state: the first two untimed, as bench_train's "
                        "--warmup 2) or timed forwards per validated plan")
    p.add_argument("--validate_runs", type=int, default=1,
                   help="launches per validated plan, taking turns with the other plans; the mean of their medians "
                        "(a process's own speed varies by a few percent from launch to launch)")
    p.add_argument("--emulate", default=None, metavar="CLUSTER_JSON",
                   help="validate on this emulated cluster (galaxy/emulate), the one the profile was measured on")
    p.add_argument("--log_level", default="WARNING", help="python logging level")
    return p


def check_model(cluster: ClusterProfile, cfg: GalaxyConfig, source: str) -> None:
    from galaxy.config import COMPUTE_KEYS

    for key, value in vars(cluster.model).items():
        if key in COMPUTE_KEYS or key == "preset":
            continue
        if getattr(cfg.model, key) != value:
            raise ConfigError(f"model key '{key}' is {getattr(cfg.model, key)!r} but the cluster file '{source}' was "
                              f"profiled with {value!r}; profile this model or pass the same --model")


def plan_config(cfg: GalaxyConfig, choice: Choice, world: int) -> dict:
    """The config the training CLIs take for ``choice`` on a cluster of ``world`` ranks; a plan on
    fewer devices names them (config key 'devices': the launchers start its ranks there)."""
    model = {k: v for k, v in vars(cfg.model).items() if k != "preset"}
    model["recompute"] = choice.layout.recompute
    att, con, mlp = choice.methods
    parallel = {"att_parallel_method": att.value, "con_parallel_method": con.value,
                "mlp_parallel_method": mlp.value, "dp_size": choice.layout.dp, "pp_size": choice.layout.pp,
                "num_microbatches": choice.layout.microbatches, "pipeline_schedule": choice.layout.schedule,
                "mp_grad_reduce": choice.mp_grad_reduce, "dp_engine": choice.dp_engine,
                "sp_attention": choice.sp_attention}
    if choice.dp_engine == "deepspeed":
        parallel["zero_stage"] = cfg.parallel.zero_stage
    if choice.dp_engine == "fsdp2" or choice.mp_grad_reduce == "fsdp":  # FSDP's settings, where not its defaults
        for key in ("reshard_after_forward", "fsdp_grad_sync"):
            if getattr(choice, key) != getattr(ParallelConfig, key):
                parallel[key] = getattr(choice, key)
    for var, key in (("heads", "tp_num_attention_heads_list"), ("ffn", "tp_intermediate_size_list"),
                     ("seq", "seq_scatter_list")):
        if var in choice.uses:
            parallel[key] = list(getattr(choice, var))
    train = {k: getattr(cfg.train, k) for k in ("global_batch_size", "seq_length", "dtype", "optimizer", "lr",
                                                 "seed", "device")}
    config = {"model": model, "parallel": parallel, "train": train}
    if choice.devices != tuple(range(world)):
        config["distributed"] = {"devices": list(choice.devices)}
    return config


def table_rows(choices: list[Choice]) -> list[dict]:
    rows = []
    for i, c in enumerate(choices):
        rows.append({"rank": i + 1, "plan": c.name, "devices": list(c.devices),
                     "att/con/mlp": "/".join(m.value for m in c.methods),
                     "dp x pp x mp": f"{c.layout.dp}x{c.layout.pp}x{len(c.seq)}",
                     "dp engine": c.engine if c.layout.dp > 1 else None,
                     "mp grad": c.mp_grad_reduce if len(c.seq) > 1 else None,
                     "sp attention": c.sp_attention if c.methods[0] == Method.SP and len(c.seq) > 1 else None,
                     "microbatches": c.layout.microbatches,
                     "recompute": c.layout.recompute,
                     "heads": list(c.heads) if "heads" in c.uses else None,
                     "ffn": list(c.ffn) if "ffn" in c.uses else None,
                     "seq": list(c.seq) if "seq" in c.uses else None,
                     "predicted_ms": round(c.time_s * 1e3, 3), "max_memory_mb": round(max(c.memory_bytes) / 2**20, 1),
                     "fits": c.fits, "exact_split": c.exact,
                     "lower_bound_ms": None if c.lower_bound_s is None else round(c.lower_bound_s * 1e3, 3)})
    return rows


def print_table(rows: list[dict], measured: Optional[list[Optional[float]]] = None) -> None:
    cols = ["rank", "plan", "devices", "att/con/mlp", "dp x pp x mp", "dp engine", "mp grad", "sp attention",
            "microbatches",
            "recompute", "heads", "ffn", "seq",
            "predicted_ms", "lower_bound_ms", "max_memory_mb", "fits"]
    cells = [[str(r[c]) if r[c] is not None else "-" for c in cols] for r in rows]
    if measured is not None:
        cols = cols + ["measured_ms", "error"]
        for row, r, m in zip(cells, rows, measured):
            row += ["-", "-"] if m is None else [f"{m * 1e3:.3f}", f"{(r['predicted_ms'] / (m * 1e3) - 1) * 100:+.1f}%"]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def plan_main(argv: list[str], prog: Optional[str] = None) -> int:
    args = plan_parser(prog).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = workload_config(args)
        cluster = load_cluster(args.cluster)
        check_model(cluster, cfg, args.cluster)
        check_output_path("out", args.out)
        check_output_path("table", args.table)
        if args.top < 1 or args.validate < 0 or args.validate_steps < 2 or args.validate_runs < 1:
            raise ConfigError("--top must be at least 1, --validate at least 0, --validate_steps at least 2 and "
                              "--validate_runs at least 1")
        if args.validate and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each rank would launch every plan
            raise ConfigError(f"--validate starts each plan's ranks itself, but this process is one of "
                              f"{os.environ['WORLD_SIZE']} (WORLD_SIZE, e.g. torchrun); run plan_galaxy.py with python")
        if args.emulate:
            from galaxy.emulate import Cluster, cgroups

            emulated = Cluster.from_file(args.emulate)
            if emulated.world_size != cluster.world:
                raise ConfigError(f"--emulate '{args.emulate}' has {emulated.world_size} ranks but the cluster file "
                                  f"'{args.cluster}' was profiled on {cluster.world}; pass the cluster it measured")
            cgroups.placement(emulated, cgroups.host_cpus())
        work = Workload(cfg.model, args.objective, cfg.train.global_batch_size, cfg.train.seq_length,
                        cfg.train.dtype, cfg.train.optimizer, cfg.parallel.mp_grad_reduce, cfg.parallel.dp_engine,
                        cfg.parallel.zero_stage, cfg.parallel.reshard_after_forward, cfg.parallel.fsdp_grad_sync,
                        cfg.parallel.sp_attention)
        stage(f"search: plans of {cfg.model.model_type} ({cfg.model.num_hidden_layers} layers) on the "
              f"{cluster.world} ranks of '{args.cluster}', objective {args.objective}")
        started = time.perf_counter()
        choices = search(cluster, work, args.ffn_unit, args.seq_unit, top=max(args.top, args.validate),
                         split_margin=args.split_margin, device_margin=args.device_margin,
                         dp_engines=args.dp_engines, mp_grad_reduces=args.mp_grad_reduces,
                         sp_attentions=args.sp_attentions)
        configs = [plan_config(cfg, c, cluster.world) for c in choices]
        for config, choice in zip(configs, choices):  # every written plan must load and resolve as the CLIs will
            GalaxyConfig.from_dict(config).resolve_plan(len(choice.devices) // (choice.layout.dp * choice.layout.pp))
    except (UserError, FileNotFoundError) as e:
        return bad_input(e)
    with open(args.out, "w") as f:
        json.dump(configs[0], f, indent=2)
    print(f"searched in {time.perf_counter() - started:.2f}s; best plan written to {args.out}", flush=True)
    rows = table_rows(choices)
    validated = validate_all(configs[:args.validate], choices, args)
    measured = None
    picked = 0
    if validated:
        validated += [None] * (len(rows) - len(validated))
        measured = [None if v is None else v.seconds for v in validated]
        for row, v in zip(rows, validated):
            row["measured_ms"] = None if v is None else round(v.seconds * 1e3, 3)
            # rank 0's peak (the prediction's max_memory_mb is the largest rank's): training runs only
            row["measured_peak_mb_rank0"] = None if v is None or v.peak_mb is None else round(v.peak_mb, 1)
        # as an autotuner does: the model ranks, the measurement picks among the plans it ran
        ran = [i for i, m in enumerate(measured) if m is not None]
        if ran:
            picked = min(ran, key=lambda i: measured[i])
            with open(args.out, "w") as f:
                json.dump(configs[picked], f, indent=2)
            print(f"the fastest validated plan (rank {rows[picked]['rank']}, {measured[picked] * 1e3:.1f} ms measured) "
                  f"written to {args.out}", flush=True)
    table_path = args.table or os.path.splitext(args.out)[0] + ".plans.json"
    with open(table_path, "w") as f:
        json.dump({"objective": args.objective, "cluster": args.cluster, "plans": rows, "configs": configs,
                   "picked": picked}, f, indent=2)
    print(f"top {len(rows)} plans written to {table_path}")
    print_table(rows[:args.top], measured[:args.top] if measured else None)
    return 0


# ----------------------------------------------------------------------------- validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Measured:
    seconds: float  # a step (train) or a batch-1 forward (latency)
    peak_mb: Optional[float] = None  # rank 0's peak memory (train; None for latency)


def validate_all(configs: list[dict], choices: list[Choice], args: argparse.Namespace) -> list[Optional[Measured]]:
    """Each validated plan: ``--validate_runs`` launches each, the plans taking turns (a slow spell of
    the machine then touches every plan alike), the mean of the launches' seconds and the largest
    peak; None for a plan whose every launch failed."""
    runs: list[list[Measured]] = [[] for _ in configs]
    total = args.validate_runs * len(configs)
    for turn in range(args.validate_runs):
        for i, (taken, config, choice) in enumerate(zip(runs, configs, choices)):
            done = turn * len(configs) + i + 1
            stage(f"validate {done}/{total}: plan {i + 1} ({choice.name}, {'/'.join(m.value for m in choice.methods)}) "
                  f"on {len(choice.devices)} rank(s), {args.validate_steps} "
                  f"{'steps' if args.objective == 'train' else 'forwards'}")
            measured = validate(config, len(choice.devices), args)
            if measured is not None:
                taken.append(measured)
            stage(f"validate {done}/{total}: " + (f"{measured.seconds * 1e3:.1f} ms measured, "
                                                  f"{choice.time_s * 1e3:.1f} ms predicted"
                                                  if measured is not None else "the run failed"))
    peaks = [[m.peak_mb for m in t if m.peak_mb is not None] for t in runs]
    return [Measured(statistics.mean(m.seconds for m in t), max(p) if p else None) if t else None
            for t, p in zip(runs, peaks)]


def failure_said(stderr: str) -> str:
    """What a failed run said of its failure: the launcher's error lines (the failing rank's own,
    ``error (rank R): ...``, then ``error: rank R exited ...``), else its last line."""
    lines = stderr.strip().splitlines()
    said = [line for line in lines if line.startswith("error")]
    return " / ".join(said[-2:]) if said else (lines[-1] if lines else "no output")


def validate(config: dict, world: int, args: argparse.Namespace) -> Optional[Measured]:
    """Run one plan through the CLI a user would run it with (``pretrain_galaxy.py`` for training,
    ``infer_galaxy.py`` for latency), on ``world`` local processes or on the emulated cluster of
    ``--emulate`` (a plan on some of its devices starts there); its median measured step (the run's
    steady state: galaxy.train.metrics.SteadyState, bench_train's definition) or batch-1 forward, in
    seconds, robust to a few disturbed steps, and a training run's peak memory on rank 0."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out, summary = (os.path.join(tmp, name) for name in ("plan.json", "measured.json", "summary.json"))
        with open(path, "w") as f:
            json.dump(config, f)
        where = ["--emulate", args.emulate] if args.emulate else ["--world", str(world)]
        if args.objective == "train":
            argv = ["pretrain_galaxy.py", "--max_steps", str(args.validate_steps), "--metrics_file", out,
                    "--summary_json", summary, "--no_progress", "--override", "log_every=1000000"]
        else:
            argv = ["infer_galaxy.py", "--warmup", "2", "--reps", str(args.validate_steps), "--summary_json", out]
        run = subprocess.run([sys.executable, os.path.join(ROOT, argv[0]), "--config", path, *where, *argv[1:],
                              "--log_level", args.log_level], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
        wrote = [out] + ([summary] if args.objective == "train" else [])
        if run.returncode != 0 or not all(map(os.path.isfile, wrote)):
            logger.warning("validation run of %s failed (exit %s): %s", config["parallel"], run.returncode,
                           failure_said(run.stderr))
            return None
        with open(out) as f:
            if args.objective == "latency":
                return Measured(json.load(f)["forward"]["median_ms"] / 1e3)
            lines = [json.loads(line) for line in f]
        with open(summary) as f:
            return Measured(json.load(f)["step_time_s"], max(line["peak_mem_mb"] for line in lines))


@interruptible
def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """``profile ...``: step 1 (``profile_main``); anything else: step 2, the search (``plan_main``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "profile":
        return profile_main(argv[1:], f"{prog or os.path.basename(sys.argv[0])} profile")
    return plan_main(argv, prog)
