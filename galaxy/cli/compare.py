"""Compare tuning methods (full, LoRA, adapters, side-tuning) on one model and plan: same data, same
seed, same steps. Prints a table (trainable / total parameters, trainable %, peak memory, saved
activations, step time, tokens/s, final loss) and writes it as JSON plus a PNG (loss curves, bars
for memory and speed).

    python compare_tuning.py --model bert --plan galaxy --world 2
    python compare_tuning.py --model llama --plan galaxy --world 2 --max_steps 50

Each method runs in fresh processes, so the peak memory of one is not carried into the next. On
CPU "peak memory" is the rank-0 process's resident peak (it includes the Python and torch runtime);
"saved activations" (tensors autograd keeps for backward in one step, rank 0) is the device-
independent part of what the methods change. BERT trains masked-LM on the synthetic corpus (the
pretraining data), LLaMA fine-tunes on the shipped Alpaca sample (the finetune_llama.py data).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing
import os
import sys
from dataclasses import replace

import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models import build_model
from galaxy.peft import METHODS, apply_tuning, trainable_parameters
from galaxy.cli.args import load_config
from galaxy.cli.launch import Launch, check_plan_for_cli, launch_ranks, run_rank
from galaxy.cli.output import setup_logging
from galaxy.cli.pretrain import DEFAULT_BERT
from galaxy.train.loop import train

logger = logging.getLogger(__name__)

COLUMNS = [("method", "method", "{}"), ("trainable_params", "trainable", "{:,}"), ("total_params", "total", "{:,}"),
           ("trainable_pct", "trainable %", "{:.3f}"), ("peak_mem_mb", "peak mem MB", "{:.1f}"),
           ("saved_act_mb", "saved act MB", "{:.2f}"), ("step_time_s", "step s", "{:.4f}"),
           ("tokens_per_s", "tokens/s", "{:,.0f}"), ("final_loss", "final loss", "{:.4f}")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("bert", "llama"), default="bert")
    p.add_argument("--plan", default="galaxy", help="parallel plan preset when the config names none")
    p.add_argument("--world", type=int, default=2, help="model-parallel ranks (local processes)")
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--config_file", default=None, help="JSON config; omitted: the CLIs' small defaults")
    p.add_argument("--model_path", default=None, help="start every method from this local HF checkpoint")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out_dir", default="compare_tuning_out")
    p.add_argument("--shared_processes", action="store_true",
                   help="run all methods in one set of rank processes (faster; CPU peak memory then accumulates)")
    p.add_argument("--in_process", action="store_true",
                   help="world 1 only: run every method in this process (no start-up cost; memory accumulates)")
    p.add_argument("--log_level", default="WARNING")
    args = p.parse_args(argv)
    # load_config reads these CLI flags as well
    args.data = args.tokenizer = None
    return args


def method_config(args: argparse.Namespace, method: str) -> GalaxyConfig:
    if args.model == "llama":
        from galaxy.cli.finetune import DEFAULT_LLAMA as default
    else:
        default = DEFAULT_BERT
    cfg = load_config(args, default)
    if cfg.model.model_type != args.model:
        raise ConfigError(f"config key 'model_type' is '{cfg.model.model_type}' but --model is {args.model}")
    if cfg.parallel.dp_size > 1 or cfg.parallel.pp_size > 1:
        raise ConfigError("compare_tuning.py runs one model-parallel group; set dp_size = pp_size = 1")
    check_plan_for_cli(cfg, args.plan, args.world, strict=False)
    cfg.peft.tuning = method
    cfg.resolve_plan(args.world)  # split errors surface before any process starts
    return cfg


def batches(cfg: GalaxyConfig, plan):
    """(batch_at, vocab_size) for the model type: MLM on the pretraining corpus, or Alpaca for LLaMA."""
    if cfg.model.model_type == "bert":
        from galaxy.data.pretraining import mlm_data

        return mlm_data(cfg)
    from galaxy.data.instruction import InstructionBatcher, load_instruction_data
    from galaxy.train.finetune import (DEFAULT_DATA, finetune_tokenizer, instruction_batches, match_vocab,
                                       shards_sequence)

    tokenizer = finetune_tokenizer(cfg)
    match_vocab(cfg, tokenizer)
    t = cfg.train
    batcher = InstructionBatcher(load_instruction_data(cfg.data.data or DEFAULT_DATA), tokenizer, t.seq_length,
                                 t.global_batch_size, seed=t.seed)
    return instruction_batches(batcher, t.seq_length if shards_sequence(plan) else None), cfg.model.vocab_size


def saved_activation_mb(model, batch: dict) -> float:
    """MiB of distinct non-parameter tensors autograd keeps for backward in one training step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values()) / 2**20


def run_one(cfg: GalaxyConfig, method: str, ctx: ParallelContext, world: int) -> dict:
    """Build, tune and train one method on this rank; rank 0's row of the table."""
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    plan = cfg.resolve_plan(ctx.mp.size)
    batch_at, vocab_size = batches(cfg, plan)
    cfg.model.vocab_size = vocab_size
    model = apply_tuning(build_model(cfg, plan, ctx), cfg)
    trainable, total = trainable_parameters(model)
    if cfg.train.dtype == "float64":
        model.double()
    model.train()
    saved_mb = saved_activation_mb(model, {k: v.to(ctx.device) for k, v in batch_at(0).items()})
    result = train(model, batch_at, cfg, ctx, progress=False)
    row = dict(method=method, trainable_params=trainable, total_params=total, trainable_pct=100.0 * trainable / total,
               saved_act_mb=saved_mb, losses=result.losses, plan=plan.name, world=world, device=str(ctx.device))
    row.update(result.summary())
    row["tokens_per_s"], row["step_time_s"] = result.tokens_per_s, result.step_time_s
    return row


def compare_rank(rank: int, launch: Launch, payload) -> None:
    """Every method of ``payload`` in turn on one rank; rank 0 writes each row to its JSON file."""
    jobs, log_level = payload
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world))
    setup_logging(log_level)
    first = jobs[0][0]
    dist_cfg = replace(first.distributed, init_method=launch.init_method or first.distributed.init_method)
    base = ParallelContext.initialize(dist_cfg, rank, launch.world, first.train.device, seed=first.train.seed)
    try:
        for cfg, method, result_file in jobs:
            # Fresh dropout streams per method (same groups): every method sees the same randomness.
            ctx = replace(base, _generators={})
            row = run_one(cfg, method, ctx, launch.world)
            if rank == 0:
                with open(result_file, "w") as f:
                    json.dump(row, f)
            gc.collect()
    finally:
        base.shutdown()


def _single(launch: Launch, payload) -> None:
    sys.exit(run_rank(compare_rank, 0, launch, payload))


def run_methods(jobs: list, world: int, log_level: str, in_process: bool = False) -> int:
    """Run ``jobs`` ([(cfg, method, result_file)]) on ``world`` fresh local processes (``in_process``:
    world 1 in this process)."""
    payload = (jobs, log_level)
    launch = Launch(world, None, None, None)
    if in_process:
        return run_rank(compare_rank, 0, launch, payload)
    if world > 1:
        return launch_ranks(compare_rank, launch, payload, jobs[0][0])
    # One rank still gets its own process, so its peak memory is its own.
    proc = multiprocessing.get_context("spawn").Process(target=_single, args=(launch, payload))
    proc.start()
    proc.join()
    return proc.exitcode


def format_table(rows: list[dict]) -> str:
    cells = [[head for _, head, _ in COLUMNS]]
    for row in rows:
        cells.append([fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.2))
    for row in rows:
        ax_loss.plot(range(1, len(row["losses"]) + 1), row["losses"], label=row["method"])
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_loss.legend()
    names = [r["method"] for r in rows]
    x = range(len(rows))
    ax_mem.bar([i - 0.2 for i in x], [r["peak_mem_mb"] for r in rows], width=0.4, label="peak memory")
    ax_mem.bar([i + 0.2 for i in x], [r["saved_act_mb"] for r in rows], width=0.4, label="saved activations")
    ax_mem.set(title="memory (MiB, rank 0)", xticks=list(x), xticklabels=names)
    ax_mem.legend()
    ax_speed.bar(names, [r["tokens_per_s"] for r in rows], color="tab:green")
    ax_speed.set(title="throughput (tokens/s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        print(f"error: --methods {args.methods}: use a subset of {','.join(METHODS)}", file=sys.stderr)
        return 2
    if args.world < 1 or (args.in_process and args.world != 1):
        print("error: --world must be at least 1 (and 1 with --in_process)", file=sys.stderr)
        return 2
    try:
        configs = {m: method_config(args, m) for m in methods}
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    jobs = []
    for method in methods:
        result_file = os.path.join(args.out_dir, f"{method}.json")
        if os.path.exists(result_file):
            os.remove(result_file)
        jobs.append((configs[method], method, result_file))
    steps = configs[methods[0]].train.max_steps
    # --shared_processes: one launch for all methods (faster to start; on CPU the resident peak then
    # only grows from method to method, on CUDA it is reset per method).
    groups = [jobs] if (args.shared_processes or args.in_process) else [[job] for job in jobs]
    for group in groups:
        print(f"-- {', '.join(j[1] for j in group)}: {args.model}, plan {configs[methods[0]].parallel.plan}, "
              f"world {args.world}, {steps} steps", flush=True)
        code = run_methods(group, args.world, args.log_level, args.in_process)
        missing = [j[1] for j in group if not os.path.exists(j[2])]
        if code != 0 or missing:
            print(f"error: method(s) {missing or [j[1] for j in group]} failed (exit code {code})", file=sys.stderr)
            return 1
    rows = []
    for _, _, result_file in jobs:
        with open(result_file) as f:
            rows.append(json.load(f))
    first = configs[methods[0]]
    title = (f"{args.model} ({first.model.preset or 'custom'}), plan {rows[0]['plan']}, world {args.world}, "
             f"{first.train.max_steps} steps, batch {first.train.global_batch_size} x {first.train.seq_length}, "
             f"{rows[0]['device']}")
    table = format_table(rows)
    print(f"\n== tuning comparison: {title} ==\n{table}")
    report = {"model": args.model, "plan": rows[0]["plan"], "world": args.world, "title": title,
              "config": first.to_dict(), "results": rows}
    json_path = os.path.join(args.out_dir, "compare_tuning.json")
    png_path = os.path.join(args.out_dir, "compare_tuning.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot(rows, title, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0

