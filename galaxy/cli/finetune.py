"""``finetune_llama.py``: LLaMA instruction fine-tuning on any plan. Checks every input before a
process starts (one line, exit 2), launches the ranks, trains with the shared loop, prints a summary."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Optional

from galaxy.cli.args import build_parser, load_config
from galaxy.cli.launch import interruptible, launch_ranks, train_from_args
from galaxy.cli.output import bad_input, print_summary, setup_logging
from galaxy.cli.run import Run, prepare, ranks_of
from galaxy.config import ConfigError, GalaxyConfig
from galaxy.data.instruction import InstructionBatcher, load_instruction_data
from galaxy.errors import UserError
from galaxy.models import family, model_types
from galaxy.peft import apply_tuning, build_base
from galaxy.planner.activation import resolve_activation_memory
from galaxy.train.finetune import (DEFAULT_DATA, check_prompt_length, encode_prompt, finetune_tokenizer,
                                   greedy_answer, instruction_batches, match_vocab, shards_sequence)

logger = logging.getLogger(__name__)

# The embedded default: llama-tiny on the shipped Alpaca sample with the byte tokenizer. Byte-level
# Alpaca prompts are 160-300 tokens, so seq_length 320 keeps every example of the sample whole
# (batches are padded to their longest row, not to 320, except under SP). The loss falls from
# ~5.6 to well under 1 in a few hundred steps on two CPU cores.
DEFAULT_LLAMA = {
    "model": {"preset": "llama-tiny", "vocab_size": 259},
    "train": {"global_batch_size": 8, "seq_length": 320, "max_steps": 300, "lr": 3e-3, "warmup_steps": 20,
              "lr_schedule": "cosine", "weight_decay": 0.0, "log_every": 10},
}
DEFAULT_PLAN = "galaxy"  # used when the config names none (as pretrain_galaxy.py)
DESCRIPTION = """LLaMA instruction fine-tuning on any plan, full or PEFT (default galaxy: ATT TP, CON SP, MLP TP), with
data and pipeline parallelism from the config: world = dp_size x pp_size x mp (e.g. --plan none --override
pp_size=2 --world 2: two pipeline stages)."""


@dataclass(frozen=True)
class FineTuning:
    """A fine-tuning run's own inputs: its batchers (made and checked before any rank starts) and the prompt
    whose greedy answer rank 0 prints after training."""

    batcher: InstructionBatcher
    eval_batcher: Optional[InstructionBatcher]
    prompt: Optional[str] = None
    prompt_input: str = ""
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError(f"--max_new_tokens must be non-negative, got {self.max_new_tokens}")


def add_finetune_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompt", default=None, metavar="TEXT",
                        help="after training, print the model's greedy answer to this instruction (Alpaca format)")
    parser.add_argument("--prompt_input", default="", metavar="TEXT",
                        help="the Alpaca 'input' field that goes with --prompt")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="longest answer --prompt generates")
    parser.add_argument("--pack", action="store_true",
                        help="pack several whole examples per row instead of one padded example per row")
    return parser


def prepare_data(args: argparse.Namespace) -> tuple[GalaxyConfig, InstructionBatcher, Optional[InstructionBatcher]]:
    """Config, training batcher and (with ``eval_every``) held-out batcher from the parsed flags:
    the held-out examples are ``eval_data``, else the last tenth of the data. Raises ConfigError /
    ValueError / FileNotFoundError with a one-line message for any bad input."""
    cfg = load_config(args, DEFAULT_LLAMA)
    if not family(cfg.model.model_type).causal:
        raise ConfigError(f"config key 'model_type' is '{cfg.model.model_type}' but this CLI fine-tunes causal LMs; "
                          f"use one of {', '.join(model_types(causal=True))} (the pretrain_*.py CLIs train "
                          f"{', '.join(model_types(causal=False))})")
    if cfg.parallel.pp_size > 1 and args.prompt is not None:
        raise ConfigError(f"--prompt needs the whole model on one rank but pp_size is {cfg.parallel.pp_size}; "
                          "drop --prompt, or generate from a checkpoint saved by this run")
    tokenizer = finetune_tokenizer(cfg)
    match_vocab(cfg, tokenizer)
    examples = load_instruction_data(cfg.data.data or DEFAULT_DATA)
    t = cfg.train
    eval_batcher = None
    if t.eval_every:
        if cfg.data.eval_data:
            held_out = load_instruction_data(cfg.data.eval_data)
        else:  # the last tenth of the examples (at least one) is held out of training
            cut = len(examples) - max(1, len(examples) // 10)
            if cut < 1:
                raise ConfigError(f"config key 'eval_every' needs held-out examples but the data has only "
                                  f"{len(examples)}; add examples or give 'eval_data'")
            examples, held_out = examples[:cut], examples[cut:]
        eval_batcher = InstructionBatcher(held_out, tokenizer, t.seq_length, t.global_batch_size, seed=t.seed)
    batcher = InstructionBatcher(examples, tokenizer, t.seq_length, t.global_batch_size, seed=t.seed, pack=args.pack)
    return cfg, batcher, eval_batcher


def finetune_body(ctx, run: Run) -> None:
    cfg, plan, job = run.cfg, run.plan, run.job
    cfg = resolve_activation_memory(cfg, ctx)
    model = apply_tuning(build_base(cfg, plan, ctx), cfg)
    fixed = cfg.train.seq_length if shards_sequence(plan) else None
    batch_at = instruction_batches(job.batcher, fixed)
    eval_at = instruction_batches(job.eval_batcher, fixed) if job.eval_batcher is not None else None
    result = train_from_args(model, batch_at, cfg, ctx, run.options, eval_at)
    answer = None
    if job.prompt is not None:
        answer = greedy_answer(model, job.batcher.tokenizer, job.prompt, job.prompt_input, job.max_new_tokens)
    if ctx.rank == 0:
        fields = {"plan": plan.name, "world": ctx.world_size, "device": str(ctx.device),
                  "att/con/mlp": "/".join(m.value for m in (plan.att, plan.con, plan.mlp)),
                  "seq_split": list(plan.seq_split), "tokenizer": repr(job.batcher.tokenizer),
                  "vocab_size": cfg.model.vocab_size, "examples": job.batcher.num_examples,
                  "rows": job.batcher.num_rows, "pack": job.batcher.pack}
        fields.update(result.summary())
        if job.prompt is not None:
            fields["prompt"] = job.prompt + (f" | {job.prompt_input}" if job.prompt_input else "")
            fields["answer"] = answer
        print_summary("fine-tuning summary", fields, run.options.summary_json)


@interruptible
def main(argv: Optional[list[str]] = None, plan: str = DEFAULT_PLAN, strict: bool = False,
         description: str = DESCRIPTION, fill: Optional[str] = None, prog: Optional[str] = None) -> int:
    """``plan``: used when the config names none (``--plan`` sets it); ``strict``: the config may not name
    another; ``fill``: 'dp' or 'pp', the dimension that takes the ranks a plain config leaves over; ``prog``:
    the command's name in its help."""
    args = add_finetune_flags(build_parser(description, prog, plan)).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg, batcher, eval_batcher = prepare_data(args)
        job = FineTuning(batcher, eval_batcher, args.prompt, args.prompt_input, args.max_new_tokens)
        launch, run = prepare(args, cfg, plan, strict, fill, job=job)
        if job.prompt is not None:
            check_prompt_length(len(encode_prompt(batcher.tokenizer, job.prompt, job.prompt_input)), run.plan)
    except (UserError, ValueError, FileNotFoundError) as e:
        return bad_input(e)
    return launch_ranks(ranks_of(finetune_body), launch, run, cfg)
