"""Compare tuning methods (full, LoRA, adapters, side-tuning, LoRA over a bf16 base, QLoRA over an NF4 base,
LoRA over an fp8 base) as fine-tuning methods: each starts from the same pretrained base and is tuned on
the same downstream task, same seed, same steps, then scored on held-out data. Prints a table (held-out
metric of the un-tuned base and after tuning, trainable / total parameters, peak memory, saved
activations, step time, tokens/s) and writes it as JSON plus a PNG.

    python compare_tuning.py                                   # BERT, topic classification, CPU minutes
    python compare_tuning.py --model bert --plan galaxy --world 2 --data my_labels.jsonl
    python compare_tuning.py --model llama --model_path my_llama_dir --max_steps 50

The base is ``--model_path`` (a local HF checkpoint), or one pretrained here once and cached (see
``galaxy.cli.compare_tasks``): BERT a masked LM on unlabelled text, LLaMA a causal LM on the training
examples' text. Tasks: BERT sequence classification (held-out accuracy), LLaMA instruction tuning
(held-out loss and perplexity). Each method runs in fresh processes, so the peak memory of one is not
carried into the next. On CPU "peak memory" is the rank-0 process's resident peak (it includes the
Python and torch runtime); "saved activations" (tensors autograd keeps for backward in one step, rank 0)
is the device-independent part of what the methods change.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Optional

import torch

from galaxy.cli.args import build_config, checkpoint_model, flag_overrides, load_config, new_parser
from galaxy.cli.compare_tasks import base_tokenizer, load_base, pretrained_base, topic_documents, write_topic_task
from galaxy.cli.launch import Launch, interruptible, launch_local, launch_ranks, rank_context, run_rank
from galaxy.cli.output import bad_input, check_output_path, setup_logging
from galaxy.cli.run import check_plan_for_cli
from galaxy.config import PLAN_PRESETS, ConfigError, GalaxyConfig, Plan, canonical_keys, read_config_file
from galaxy.core.context import ParallelContext
from galaxy.data.files import check_text_file
from galaxy.errors import UserError
from galaxy.models import build_model, family, model_types
from galaxy.peft import METHODS, apply_tuning, trainable_parameters
from galaxy.train.evaluate import evaluate
from galaxy.train.loop import autocast_context, make_trainer, train

logger = logging.getLogger(__name__)

# The task a family is tuned on: instruction tuning for a causal LM, sequence classification otherwise.
TASKS = {True: "instruction", False: "classification"}
# The defaults per task (the model is the family's default preset): small enough that pretraining the
# base once and tuning every method takes a few minutes on two CPU cores, large enough that every
# method's held-out metric moves clearly.
DEFAULTS = {
    # Mean pooling: a base pretrained on masked LM alone never trains its [CLS] state, and methods that
    # leave attention frozen (adapters, side networks) cannot make it carry the sequence.
    "classification": {"model": {"vocab_size": 400, "max_position_embeddings": 64, "num_labels": 4,
                       "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_pooling": "mean"},
             "train": {"global_batch_size": 16, "seq_length": 32, "max_steps": 80, "lr": 1e-3, "warmup_steps": 5,
                       "weight_decay": 0.0, "eval_iters": 8},
             "peft": {"lora_dim": 8, "lora_alpha": 16, "lora_dropout": 0.0}},
    "instruction": {"model": {"vocab_size": 259},
              "train": {"global_batch_size": 8, "seq_length": 320, "max_steps": 60, "lr": 1e-3, "warmup_steps": 5,
                        "weight_decay": 0.0, "eval_iters": 1},
              "peft": {"lora_dim": 8, "lora_alpha": 16, "lora_dropout": 0.0}},
}
PRETRAIN_STEPS = {"classification": 300, "instruction": 200}
# Learning rates as researchers set them: PEFT methods train few parameters from zero and take a larger
# one than full fine-tuning (used unless a config file or --override sets lr).
METHOD_LR = {"full": 1e-3, "lora": 5e-3, "adapter": 5e-3, "side": 5e-3}
# LoRA over a frozen base held in bf16 (bf16 autocast), QLoRA over the NF4-quantized base, LoRA over the
# fp8 base (galaxy.loralib.fp8: its products on fp8 values, the activations quantized per row), and over the
# fp8 base with the output head's logits on fp8 too (quantize_head).
VARIANTS = {"lora-bf16": ("lora", {"dtype": "bfloat16"}, {}),
            "qlora": ("lora", {"dtype": "bfloat16"}, {"quantize_base": "nf4"}),
            "lora-fp8": ("lora", {"dtype": "bfloat16"}, {"quantize_base": "fp8"}),
            "lora-fp8head": ("lora", {"dtype": "bfloat16"}, {"quantize_base": "fp8", "quantize_head": True})}
COMPARED = METHODS + tuple(VARIANTS)
# What a run compares unless --methods names others: lora-fp8head only by name (a causal LM's head; BERT has none).
DEFAULT_METHODS = tuple(m for m in COMPARED if m != "lora-fp8head")
METRIC = {"classification": ("eval_accuracy", "held-out accuracy"),
          "instruction": ("eval_perplexity", "held-out perplexity")}

COLUMNS = [("method", "method", "{}"), ("metric_before", "base metric", "{:.4f}"),
           ("metric_after", "tuned metric", "{:.4f}"), ("eval_loss_after", "held-out loss", "{:.4f}"),
           ("trainable_params", "trainable", "{:,}"), ("trainable_pct", "trainable %", "{:.3f}"),
           ("peak_mem_mb", "peak mem MB", "{:.1f}"), ("saved_act_mb", "saved act MB", "{:.2f}"),
           ("step_time_s", "step s", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:,.0f}")]


def task_of(model_type: str) -> str:
    return TASKS[family(model_type).causal]


def defaults(model_type: str) -> dict:
    """The embedded config of ``model_type``: its task's defaults on the family's default preset."""
    task = DEFAULTS[task_of(model_type)]
    return dict(task, model=dict(task["model"], **family(model_type).tiny_config))


DESCRIPTION = "full / LoRA / adapter / side tuning from one base on a held-out task"


def parse_args(argv=None, prog: Optional[str] = None) -> argparse.Namespace:
    p = new_parser(prog, DESCRIPTION)
    p.add_argument("--model", choices=model_types(), default=None,
                   help="model family (default: the --model_path checkpoint's, else "
                        f"{model_types(causal=False)[0]})")
    p.add_argument("--plan", choices=sorted(PLAN_PRESETS), default=None,
                   help="parallel plan (default: the config's, else none)")
    p.add_argument("--world", type=int, default=1, help="model-parallel ranks (local processes)")
    p.add_argument("--max_steps", type=int, default=None, help="tuning steps per method (default: the model's)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated subset of " + ",".join(COMPARED))
    p.add_argument("--config_file", "--config", dest="config_file", default=None,
                   help="JSON config; omitted: the small defaults of the model's task")
    p.add_argument("--model_path", dest="base_path", default=None,
                   help="the base: a local HF checkpoint, whose config.json sets the model (default: pretrain one "
                        "here)")
    p.add_argument("--data", dest="task_data", default=None,
                   help="the task's training file (BERT: {text, label} JSONL; LLaMA: Alpaca JSON/JSONL); default: "
                        "generated topics / the Alpaca sample")
    p.add_argument("--eval_data", default=None, help="held-out file of the same kind (default: generated topics / "
                                                     "the last tenth of --data)")
    p.add_argument("--pretrain_steps", type=int, default=None, help="steps of the base pretrained here")
    p.add_argument("--cache_dir", default=None, help="where pretrained bases are kept (default ~/.cache/galaxy)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the config's)")
    p.add_argument("--out_dir", default="compare_tuning_out", help="the table, JSON and PNG go here")
    p.add_argument("--shared_processes", action="store_true",
                   help="run all methods in one set of rank processes (faster; CPU peak memory then accumulates)")
    p.add_argument("--in_process", action="store_true",
                   help="world 1 only: run every method in this process (no start-up cost; memory accumulates)")
    p.add_argument("--log_level", default="WARNING", help="python logging level")
    return p.parse_args(argv)


def model_family(args: argparse.Namespace) -> str:
    """The model compared: ``--model``, else the family of the ``--model_path`` checkpoint or of the config
    file, else the first masked LM (the two must agree)."""
    named = args.model
    if args.base_path:
        found = checkpoint_model(args.base_path).model_type
        if named is not None and named != found:
            raise ConfigError(f"--model is {named} but the checkpoint '{args.base_path}' holds a {found} model; drop "
                              "--model or pass a checkpoint of that family")
        return found
    if named is None and args.config_file:
        named = canonical_keys(read_config_file(args.config_file)).get("model_type")
    return named or model_types(causal=False)[0]


def base_config(args: argparse.Namespace, base: str) -> GalaxyConfig:
    """The run's config with the model section of the base checkpoint ``base``: a checkpoint given with
    --model_path must agree with a config file's model keys; one pretrained here was made from this config
    (its vocabulary is the tokenizer's it trained)."""
    if args.base_path:
        return build_config(args.config_file, defaults(args.model), {**flag_overrides(args), "model_path": base})
    return build_config(None, load_config(args, defaults(args.model)).to_dict(), {"model_path": base})


@dataclass(frozen=True)
class MethodRun:
    """One method's run: its config, the plan resolved before any process starts, where rank 0 writes its row."""

    method: str
    cfg: GalaxyConfig
    plan: Plan
    result_file: str


def method_run(args: argparse.Namespace, method: str, base: str) -> MethodRun:
    cfg = base_config(args, base)
    if cfg.model.model_type != args.model:
        raise ConfigError(f"config key 'model_type' is '{cfg.model.model_type}' but --model is {args.model}")
    if cfg.parallel.dp_size > 1 or cfg.parallel.pp_size > 1:
        raise ConfigError("compare_tuning.py runs one model-parallel group; set dp_size = pp_size = 1")
    check_plan_for_cli(cfg, "none", args.world, strict=False)
    tuning, train_keys, peft_keys = VARIANTS.get(method, (method, {}, {}))
    cfg.peft.tuning = tuning
    for key, value in train_keys.items():
        setattr(cfg.train, key, value)
    for key, value in peft_keys.items():
        setattr(cfg.peft, key, value)
    if not args.config_file and not any(o.split("=")[0].strip() in ("lr", "train.lr") for o in args.override):
        cfg.train.lr = METHOD_LR[tuning]
    cfg.validate()
    return MethodRun(method, cfg, cfg.resolve_plan(args.world), os.path.join(args.out_dir, f"{method}.json"))


def task_files(args: argparse.Namespace) -> tuple[str, str | None]:
    """(training file, held-out file or None) of the task."""
    if args.task_data:
        return args.task_data, args.eval_data
    if task_of(args.model) == "classification":
        return write_topic_task(os.path.join(args.out_dir, "task"))
    from galaxy.train.finetune import DEFAULT_DATA

    return DEFAULT_DATA, args.eval_data


def pretraining_texts(args: argparse.Namespace, train_file: str) -> list[str]:
    """What a base pretrained here learns from: unlabelled documents of the generated topics (a set
    apart from the task's examples), else the training file's own texts."""
    if task_of(args.model) == "classification":
        if not args.task_data:
            return [text for text, _ in topic_documents(2048, seed=99)]
        from galaxy.data.classification import load_labelled_data

        return [text for text, _ in load_labelled_data(train_file)]
    from galaxy.data.instruction import load_instruction_data

    return [" ".join(v for v in (ex["instruction"], ex["input"], ex["output"]) if v)
            for ex in held_apart(load_instruction_data(train_file), args.eval_data)[0]]


def held_apart(examples: list, eval_file):
    """(training examples, held-out examples): the held-out file's, else the last tenth (at least one)."""
    if eval_file:
        from galaxy.data.instruction import load_instruction_data

        return examples, load_instruction_data(eval_file)
    cut = len(examples) - max(1, len(examples) // 10)
    return examples[:cut], examples[cut:]


def task_batches(cfg: GalaxyConfig, plan, files: tuple[str, str | None]):
    """(batch_at, eval_at, eval_iters) of the task for this config."""
    t = cfg.train
    if task_of(cfg.model.model_type) == "classification":
        from galaxy.data.classification import ClassificationBatcher, load_labelled_data
        from galaxy.data.corpus import TextCorpus

        examples = load_labelled_data(files[0])
        if files[1]:
            held_out = load_labelled_data(files[1])
        else:
            cut = len(examples) - max(1, len(examples) // 10)
            examples, held_out = examples[:cut], examples[cut:]
        tok = base_tokenizer(cfg.data.model_path)
        corpus = TextCorpus.from_texts([text for text, _ in examples], t.seq_length, tokenizer=tok,
                                       tokenizer_dir=None if tok is not None else cfg.data.model_path,
                                       eval_fraction=0.0)
        ids = dict(cls_id=corpus.cls_id, sep_id=corpus.sep_id, pad_id=corpus.pad_id, seed=t.seed)
        train_b = ClassificationBatcher(examples, corpus.encode, t.seq_length, t.global_batch_size, **ids)
        eval_b = ClassificationBatcher(held_out, corpus.encode, t.seq_length, t.global_batch_size, **ids)
        return train_b.batch_at, eval_b.batch_at, max(1, len(held_out) // t.global_batch_size)
    from galaxy.data.instruction import InstructionBatcher, load_instruction_data
    from galaxy.train.finetune import finetune_tokenizer, instruction_batches, shards_sequence

    tokenizer = finetune_tokenizer(cfg)
    examples, held_out = held_apart(load_instruction_data(files[0]), files[1])
    fixed = t.seq_length if shards_sequence(plan) else None
    train_b = InstructionBatcher(examples, tokenizer, t.seq_length, t.global_batch_size, seed=t.seed)
    eval_b = InstructionBatcher(held_out, tokenizer, t.seq_length, t.global_batch_size, seed=t.seed)
    return (instruction_batches(train_b, fixed), instruction_batches(eval_b, fixed),
            max(1, -(-len(held_out) // t.global_batch_size)))


def saved_activation_mb(model, batch: dict, autocast) -> float:
    """MiB of distinct non-parameter tensors autograd keeps for backward in one training step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        out = model(**batch)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values()) / 2**20


def run_one(job: MethodRun, files, ctx: ParallelContext, world: int) -> dict:
    """Load the base, add the method, score it on the held-out data, tune it, score it again; rank 0's
    row of the table."""
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    cfg, method, plan = job.cfg, job.method, job.plan
    batch_at, eval_at, eval_iters = task_batches(cfg, plan, files)
    task = "classify" if task_of(cfg.model.model_type) == "classification" else "lm"  # the model's head
    model = build_model(replace(cfg, data=replace(cfg.data, model_path=None)), plan, ctx, task=task)
    fresh = load_base(model, cfg.data.model_path)
    model = apply_tuning(model, cfg)
    trainable, total = trainable_parameters(model)
    if cfg.train.dtype == "float64":
        model.double()
    amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
    before = evaluate(make_trainer(model, cfg, ctx), eval_at, eval_iters, amp)
    model.train()
    saved_mb = saved_activation_mb(model, {k: v.to(ctx.device) for k, v in batch_at(0).items()}, amp)
    tuned = replace(cfg, train=replace(cfg.train, eval_every=cfg.train.max_steps, eval_iters=eval_iters))
    result = train(model, batch_at, tuned, ctx, eval_at=eval_at)
    key = METRIC[task_of(cfg.model.model_type)][0]
    row = dict(method=method, metric=key, metric_before=before[key], metric_after=result.eval[key],
               eval_loss_before=before["eval_loss"], eval_loss_after=result.eval["eval_loss"],
               fresh_from_base=fresh, trainable_params=trainable, total_params=total,
               trainable_pct=100.0 * trainable / total, saved_act_mb=saved_mb, losses=result.losses,
               plan=plan.name, world=world, device=str(ctx.device))
    row.update(result.summary())
    row["tokens_per_s"], row["step_time_s"] = result.tokens_per_s, result.step_time_s
    return row


def compare_rank(rank: int, launch: Launch, payload) -> None:
    """Every method of ``payload`` in turn on one rank; rank 0 writes each row to its JSON file."""
    jobs, files, log_level = payload
    with rank_context(rank, launch, jobs[0].cfg, log_level) as base:
        for job in jobs:
            # Fresh dropout streams per method (same groups): every method sees the same randomness.
            ctx = base.with_fresh_streams()
            row = run_one(job, files, ctx, launch.world)
            if rank == 0:
                with open(job.result_file, "w") as f:
                    json.dump(row, f)
            gc.collect()


def run_methods(jobs: list, files, world: int, log_level: str, in_process: bool = False) -> int:
    """Run ``jobs`` (``MethodRun``s) on the task ``files`` on ``world`` fresh local
    processes (``in_process``: world 1 in this process)."""
    payload = (jobs, files, log_level)
    launch = Launch(world, None, None, None)
    if in_process:
        return run_rank(compare_rank, 0, launch, payload)
    if world > 1:
        return launch_ranks(compare_rank, launch, payload, jobs[0].cfg)
    return launch_local(compare_rank, launch, payload, jobs[0].cfg)  # one rank, a process of its own: its own peak


def format_table(rows: list[dict]) -> str:
    cells = [[head for _, head, _ in COLUMNS]]
    for row in rows:
        cells.append([fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], title: str, metric: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_metric, ax_loss, ax_mem, ax_speed) = plt.subplots(1, 4, figsize=(19, 4.2))
    names = [r["method"] for r in rows]
    x = range(len(rows))
    ax_metric.bar([i - 0.2 for i in x], [r["metric_before"] for r in rows], width=0.4, label="un-tuned base")
    ax_metric.bar([i + 0.2 for i in x], [r["metric_after"] for r in rows], width=0.4, label="tuned")
    ax_metric.set(title=metric, xticks=list(x), xticklabels=names)
    ax_metric.legend()
    for row in rows:
        ax_loss.plot(range(1, len(row["losses"]) + 1), row["losses"], label=row["method"])
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_loss.legend()
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


@interruptible
def main(argv=None, prog: Optional[str] = None) -> int:
    args = parse_args(argv, prog)
    setup_logging(args.log_level)
    made_out_dir = not os.path.exists(args.out_dir)
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods or any(m not in COMPARED for m in methods):
            raise ConfigError(f"--methods {args.methods}: use a subset of {','.join(COMPARED)}")
        if args.world < 1 or (args.in_process and args.world != 1):
            raise ConfigError("--world must be at least 1 (and 1 with --in_process)")
        args.model = model_family(args)  # reads the --model_path checkpoint: a bad one is refused here
        for flag, path in (("--data", args.task_data), ("--eval_data", args.eval_data)):
            if path:
                check_text_file(path, flag)
        check_output_path("out_dir", args.out_dir, directory=True)
        files = task_files(args)
        base = args.base_path
        if base is None:
            steps = args.pretrain_steps or PRETRAIN_STEPS[task_of(args.model)]
            base, trained = pretrained_base(load_config(args, defaults(args.model)), pretraining_texts(args, files[0]),
                                            steps, args.cache_dir)
            print(f"-- base: {base} ({f'pretrained here, {steps} steps' if trained else 'an earlier run pretrained it'})",
                  flush=True)
        jobs = [method_run(args, m, base) for m in methods]
    except (UserError, FileNotFoundError, ValueError) as e:
        if made_out_dir:  # bad input leaves nothing behind
            shutil.rmtree(args.out_dir, ignore_errors=True)
        return bad_input(e)
    for job in jobs:
        if os.path.exists(job.result_file):
            os.remove(job.result_file)
    first = jobs[0].cfg
    # --shared_processes: one launch for all methods (faster to start; on CPU the resident peak then
    # only grows from method to method, on CUDA it is reset per method).
    groups = [jobs] if (args.shared_processes or args.in_process) else [[job] for job in jobs]
    for group in groups:
        print(f"-- {', '.join(j.method for j in group)}: {args.model}, plan {first.parallel.plan}, "
              f"world {args.world}, {first.train.max_steps} steps", flush=True)
        code = run_methods(group, files, args.world, args.log_level, args.in_process)
        missing = [j.method for j in group if not os.path.exists(j.result_file)]
        if code != 0 or missing:
            print(f"error: method(s) {missing or [j.method for j in group]} failed (exit code {code})",
                  file=sys.stderr)
            return 1
    rows = []
    for job in jobs:
        with open(job.result_file) as f:
            rows.append(json.load(f))
    metric = METRIC[task_of(args.model)][1]
    title = (f"{args.model} from {'its pretrained base' if args.base_path is None else args.base_path}, "
             f"plan {rows[0]['plan']}, world {args.world}, {first.train.max_steps} steps, "
             f"batch {first.train.global_batch_size} x {first.train.seq_length}, {rows[0]['device']}; {metric}")
    table = format_table(rows)
    print(f"\n== tuning comparison: {title} ==\n{table}")
    report = {"model": args.model, "plan": rows[0]["plan"], "world": args.world, "title": title, "base": base,
              "task": {"train": files[0], "held_out": files[1]}, "metric": METRIC[task_of(args.model)][0],
              "config": first.to_dict(), "results": rows}
    json_path = os.path.join(args.out_dir, "compare_tuning.json")
    png_path = os.path.join(args.out_dir, "compare_tuning.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot(rows, title, metric, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0
