"""Masked-LM pretraining of BERT on any plan, with data and pipeline parallelism around it:
the body of the pretrain_*.py CLIs (world = dp_size x pp_size x mp, mp being the plan's group)."""

from __future__ import annotations

import logging
from typing import Optional


from galaxy.config import ConfigError, GalaxyConfig
from galaxy.models import build_model
from galaxy.peft import apply_tuning
from galaxy.train.cli import (DEFAULT_BERT, bad_input, build_parser, launch_ranks, load_config, plan_launch,
                              print_summary, rank_context, setup_logging, train_from_args)

logger = logging.getLogger(__name__)


def mlm_corpus(cfg: GalaxyConfig):
    """The configured corpus: the synthetic one, or a local text file (its last documents held out)."""
    from galaxy.train.data import SyntheticCorpus, TextCorpus

    t = cfg.train
    if cfg.data.data:
        return TextCorpus.from_file(cfg.data.data, t.seq_length, tokenizer_dir=cfg.data.tokenizer,
                                    vocab_size=cfg.model.vocab_size)
    return SyntheticCorpus(cfg.model.vocab_size, t.seq_length, seed=t.seed)


def mlm_data(cfg: GalaxyConfig, corpus=None, split: str = "train"):
    """(batch_at, vocab_size) of masked-LM batches from ``split`` ('train' or the held-out 'eval')
    of ``corpus`` (default: ``mlm_corpus(cfg)``)."""
    from galaxy.train.data import MLMBatcher

    t = cfg.train
    corpus = corpus if corpus is not None else mlm_corpus(cfg)
    batcher = MLMBatcher(corpus, t.global_batch_size, mlm_probability=t.mlm_probability, seed=t.seed, split=split)
    return batcher.batch_at, corpus.vocab_size


def mlm_eval_data(cfg: GalaxyConfig, corpus):
    """Held-out masked-LM batches: the file ``eval_data`` (tokenized with ``tokenizer``, which the
    training file shares), else the corpus's own held-out split."""
    from galaxy.train.data import TextCorpus

    if not cfg.data.eval_data:
        return mlm_data(cfg, corpus, "eval")[0]
    if not cfg.data.tokenizer:
        raise ConfigError("config key 'eval_data' needs 'tokenizer' (a local HF tokenizer directory) so that the "
                          "evaluation file is tokenized like the training data; without eval_data the last "
                          "documents of 'data' are held out instead")
    held_out = TextCorpus.from_file(cfg.data.eval_data, cfg.train.seq_length, tokenizer_dir=cfg.data.tokenizer,
                                    eval_fraction=0.0)
    return mlm_data(cfg, held_out, "train")[0]


def classification_data(cfg: GalaxyConfig):
    """(batch_at, eval_at, vocab_size) for ``task: classify``: the labelled JSONL ``data``
    (``{"text", "label"}`` lines), tokenized with ``tokenizer`` or a WordPiece trained on its texts;
    held out: ``eval_data``, else the last tenth of the examples."""
    from galaxy.train.data import ClassificationBatcher, TextCorpus, load_labelled_data

    t, d = cfg.train, cfg.data
    if not d.data:
        raise ConfigError("config key 'task' is 'classify' but 'data' is not set; give a JSONL file of "
                          '{"text": ..., "label": ...} lines (--data)')
    examples = load_labelled_data(d.data)
    if d.eval_data:
        held_out = load_labelled_data(d.eval_data)
    else:
        cut = len(examples) - max(1, len(examples) // 10)
        examples, held_out = examples[:max(cut, 1)], examples[max(cut, 1):]
    top = max(label for _, label in examples + held_out)
    if top >= cfg.model.num_labels:
        raise ConfigError(f"config key 'num_labels' ({cfg.model.num_labels}) is too small for label {top} in the "
                          f"data; set num_labels to at least {top + 1}")
    corpus = TextCorpus.from_texts([text for text, _ in examples], t.seq_length, tokenizer_dir=d.tokenizer,
                                   vocab_size=cfg.model.vocab_size, eval_fraction=0.0, source=d.data)
    ids = dict(cls_id=corpus.cls_id, sep_id=corpus.sep_id, pad_id=corpus.pad_id, seed=t.seed)
    train = ClassificationBatcher(examples, corpus.encode, t.seq_length, t.global_batch_size, **ids)
    evals = ClassificationBatcher(held_out, corpus.encode, t.seq_length, t.global_batch_size, **ids) \
        if held_out else None
    return train.batch_at, evals.batch_at if evals else None, corpus.vocab_size


def pretrain_rank(rank: int, launch, payload) -> None:
    cfg, args = payload
    ctx = rank_context(rank, launch, cfg, args.log_level)
    try:
        task = cfg.train.task
        if task == "classify":
            batch_at, eval_at, vocab_size = classification_data(cfg)
            eval_at = eval_at if cfg.train.eval_every else None
        else:
            corpus = mlm_corpus(cfg)
            batch_at, vocab_size = mlm_data(cfg, corpus)
            eval_at = mlm_eval_data(cfg, corpus) if cfg.train.eval_every else None
        if vocab_size != cfg.model.vocab_size:
            logger.warning("vocab_size set to %d to match the tokenizer (config had %d)", vocab_size,
                           cfg.model.vocab_size)
            cfg.model.vocab_size = vocab_size
        plan = cfg.resolve_plan(ctx.mp.size)
        model = apply_tuning(build_model(cfg, plan, ctx, task="classify" if task == "classify" else "lm"), cfg)
        result = train_from_args(model, batch_at, cfg, ctx, args, eval_at)
        if rank == 0:
            fields = {"plan": plan.name, "world": launch.world, "device": str(ctx.device),
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
            print_summary("pretraining summary", fields, args.summary_json)
    except BaseException:
        ctx.shutdown(wait_for_peers=False)
        raise
    ctx.shutdown()


def main(argv: Optional[list[str]] = None, plan: str = "galaxy", strict: bool = False, description: str = "",
         fill: Optional[str] = None) -> int:
    """``plan``: used when the config names none; ``strict``: the config may not name another;
    ``fill``: 'dp' or 'pp', the dimension that takes the ranks a plain config leaves over."""
    args = build_parser(description).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load_config(args, DEFAULT_BERT)
        if cfg.model.model_type != "bert":
            raise ConfigError(f"config key 'model_type' is '{cfg.model.model_type}' but this CLI pretrains BERT; "
                              "use finetune_llama.py for LLaMA")
        launch = plan_launch(args, cfg, plan, strict, fill)
    except (ConfigError, FileNotFoundError) as e:
        return bad_input(e)
    return launch_ranks(pretrain_rank, launch, (cfg, args), cfg)
