"""``pretrain_*.py``, ``galaxy pretrain``: language-model pretraining on any plan, with data and pipeline
parallelism around it (world = dp_size x pp_size x mp, mp being the plan's group). The model family
decides the objective: masked-LM batches for a masked LM (BERT), packed causal-LM windows for a
causal one (LLaMA, Qwen2; ``galaxy.data.causal``). The BERT-named scripts train masked LMs only."""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from galaxy.cli.args import build_parser, load_config
from galaxy.cli.launch import interruptible, launch_ranks, train_from_args
from galaxy.cli.output import bad_input, print_summary, setup_logging, stage
from galaxy.cli.run import Run, prepare, ranks_of
from galaxy.config import ConfigError
from galaxy.data.pretraining import causal_lm_data, classification_data, mlm_corpus, mlm_data, mlm_eval_data
from galaxy.errors import UserError
from galaxy.models import family, model_types
from galaxy.peft import apply_tuning, build_base
from galaxy.planner.activation import resolve_activation_memory

logger = logging.getLogger(__name__)

# The embedded default: a small BERT on the synthetic corpus that learns visibly in about two
# minutes on two CPU cores (`python pretrain_galaxy.py --world 2`).
DEFAULT_BERT = {
    "model": {"preset": "bert-tiny", "vocab_size": 512, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 128},
    "train": {"global_batch_size": 16, "seq_length": 64, "max_steps": 600, "lr": 2e-3, "warmup_steps": 20,
              "weight_decay": 0.01, "log_every": 10},
}


DESCRIPTION = """Masked- and causal-LM pretraining on any plan (default galaxy: ATT TP, CON SP, MLP TP), with data and
pipeline parallelism from the config: world = dp_size x pp_size x mp (e.g. --plan none --override pp_size=4
--world 4: four pipeline stages)."""


def pretrain_body(ctx, run: Run) -> None:
    cfg, plan, options = run.cfg, run.plan, run.options
    task = cfg.train.task
    if cfg.data.data and ctx.rank == 0:
        stage(f"data: reading '{cfg.data.data}' ({os.path.getsize(cfg.data.data) / 2**20:.1f} MB)"
              + ("" if cfg.data.tokenizer else ", training its tokenizer"))
    started = time.perf_counter()
    if task == "classify":
        batch_at, eval_at, vocab_size = classification_data(cfg, ctx.from_rank0, options.save_dir)
        eval_at = eval_at if cfg.train.eval_every else None
    elif family(cfg.model.model_type).causal:
        batch_at, eval_at, vocab_size = causal_lm_data(cfg, ctx.from_rank0, options.save_dir)
    else:
        corpus = mlm_corpus(cfg, ctx.from_rank0, options.save_dir)
        batch_at, vocab_size = mlm_data(cfg, corpus)
        eval_at = mlm_eval_data(cfg, corpus) if cfg.train.eval_every else None
    if cfg.data.data and ctx.rank == 0:
        stage(f"data: ready in {time.perf_counter() - started:.1f}s (vocabulary {vocab_size})")
    if vocab_size != cfg.model.vocab_size:
        logger.warning("vocab_size set to %d to match the tokenizer (config had %d)", vocab_size,
                       cfg.model.vocab_size)
        cfg.model.vocab_size = vocab_size
    cfg = resolve_activation_memory(cfg, ctx)
    model = apply_tuning(build_base(cfg, plan, ctx, task="classify" if task == "classify" else "lm"), cfg)
    result = train_from_args(model, batch_at, cfg, ctx, options, eval_at)
    if ctx.rank == 0:
        fields = {"plan": plan.name, "world": ctx.world_size, "device": str(ctx.device),
                  "att/con/mlp": "/".join(m.value for m in (plan.att, plan.con, plan.mlp)),
                  "seq_split": list(plan.seq_split)}
        if ctx.dp.size > 1 or ctx.pp.size > 1:
            fields["dp x pp x mp"] = f"{ctx.dp.size} x {ctx.pp.size} x {ctx.mp.size}"
        par = cfg.parallel
        if ctx.dp.size > 1:
            fields["dp_engine"] = par.dp_engine
        if ctx.pp.size > 1 or par.num_microbatches > 1:
            fields.update({"stage_layers": list(cfg.stage_layers()), "num_microbatches": par.num_microbatches,
                           "pipeline_schedule": par.pipeline_schedule})
        fields.update(result.summary())
        print_summary("pretraining summary", fields, options.summary_json)


def check_task(cfg, masked_only: bool) -> None:
    """The family's LM is what this CLI pretrains (``masked_only``: the BERT-named scripts), and a
    ``task`` other than the LM is one the family has."""
    known = family(cfg.model.model_type)
    if masked_only and known.causal:
        raise ConfigError(f"config key 'model_type' is '{cfg.model.model_type}' but this CLI pretrains masked LMs "
                          f"({', '.join(model_types(causal=False))}); use pretrain_galaxy.py (galaxy pretrain), which "
                          "pretrains causal LMs too, with dp_size / pp_size in the config")
    if cfg.train.task == "classify" and "classify" not in known.tasks:
        raise ConfigError(f"config key 'task' is 'classify' but a {cfg.model.model_type} model has no classification "
                          "head here; use task 'mlm' (the family's language model: next-token prediction for causal "
                          "LMs)")


@interruptible
def main(argv: Optional[list[str]] = None, plan: str = "galaxy", strict: bool = False,
         description: str = DESCRIPTION, fill: Optional[str] = None, masked_only: bool = False,
         prog: Optional[str] = None) -> int:
    """``plan``: used when the config names none (``--plan`` sets it); ``strict``: the config may not name
    another; ``fill``: 'dp' or 'pp', the dimension that takes the ranks a plain config leaves over;
    ``masked_only``: refuse causal LMs (the BERT-named scripts); ``prog``: the command's name in its help."""
    args = build_parser(description, prog, plan).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load_config(args, DEFAULT_BERT)
        check_task(cfg, masked_only)
        launch, run = prepare(args, cfg, plan, strict, fill)
    except (UserError, FileNotFoundError) as e:
        return bad_input(e)
    return launch_ranks(ranks_of(pretrain_body), launch, run, cfg)
