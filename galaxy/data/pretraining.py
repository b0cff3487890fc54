"""The pretraining batches a config asks for: masked-LM and classification (BERT and its tasks), packed
causal-LM windows (LLaMA-family pretraining); the caller says which LM its model family trains.

A WordPiece learned from ``data`` is trained once per run, on global rank 0, and handed to every
rank (``galaxy.data.tokenizer.shared_wordpiece``); a ``tokenizer`` directory in the config is used
as it is.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.data.causal import CausalLMBatcher, SyntheticWindows, TokenWindows
from galaxy.data.classification import ClassificationBatcher, load_labelled_data
from galaxy.data.corpus import SyntheticCorpus, TextCorpus, read_documents
from galaxy.data.mlm import MLMBatcher
from galaxy.data.tokenizer import save_wordpiece, shared_wordpiece

TOKENIZER_DIR = "tokenizer"  # where a run saves the WordPiece it trained, inside --save_dir


def run_wordpiece(cfg: GalaxyConfig, texts: Sequence[str], share: Optional[Callable] = None,
                  save_dir: Optional[str] = None):
    """The WordPiece this run learns from ``texts`` (None when the config names a tokenizer directory).

    ``share(make)``: runs ``make`` on one rank and returns its string everywhere (``ParallelContext.
    from_rank0``); None in a single process. With ``save_dir`` the tokenizer is also written to
    ``<save_dir>/tokenizer`` as a HF tokenizer directory, which ``--tokenizer`` accepts."""
    if cfg.data.tokenizer:
        return None
    tok = shared_wordpiece(texts, cfg.model.vocab_size, share or (lambda make: make()))
    if save_dir:
        save_wordpiece(tok, os.path.join(save_dir, TOKENIZER_DIR))
    return tok


def mlm_corpus(cfg: GalaxyConfig, share: Optional[Callable] = None, save_dir: Optional[str] = None):
    """The configured corpus: the synthetic one, or a local text file (its last documents held out)."""
    t = cfg.train
    if not cfg.data.data:
        return SyntheticCorpus(cfg.model.vocab_size, t.seq_length, seed=t.seed)
    docs = read_documents(cfg.data.data)
    return TextCorpus.from_texts(docs, t.seq_length, tokenizer_dir=cfg.data.tokenizer, source=cfg.data.data,
                                 tokenizer=run_wordpiece(cfg, docs, share, save_dir))


def mlm_data(cfg: GalaxyConfig, corpus=None, split: str = "train"):
    """(batch_at, vocab_size) of masked-LM batches from ``split`` ('train' or the held-out 'eval')
    of ``corpus`` (default: ``mlm_corpus(cfg)``)."""
    t = cfg.train
    corpus = corpus if corpus is not None else mlm_corpus(cfg)
    batcher = MLMBatcher(corpus, t.global_batch_size, mlm_probability=t.mlm_probability, seed=t.seed, split=split)
    return batcher.batch_at, corpus.vocab_size


def mlm_eval_data(cfg: GalaxyConfig, corpus):
    """Held-out masked-LM batches: the file ``eval_data`` tokenized like the training data, else the
    corpus's own held-out split."""
    if not cfg.data.eval_data:
        return mlm_data(cfg, corpus, "eval")[0]
    if not cfg.data.data:
        raise ConfigError("config key 'eval_data' needs 'data' (the training file whose tokenizer it shares); "
                          "the synthetic corpus has its own held-out split")
    held_out = TextCorpus.from_file(cfg.data.eval_data, cfg.train.seq_length, tokenizer_dir=cfg.data.tokenizer,
                                    tokenizer=None if cfg.data.tokenizer else corpus.tokenizer, eval_fraction=0.0)
    return mlm_data(cfg, held_out, "train")[0]


def causal_lm_windows(cfg: GalaxyConfig, share: Optional[Callable] = None, save_dir: Optional[str] = None):
    """The configured causal-LM window source: the synthetic documents, or a local text file
    (``data``; its last tenth of documents held out), tokenized as the masked-LM path does."""
    t = cfg.train
    if not cfg.data.data:
        return SyntheticWindows(cfg.model.vocab_size, t.seq_length, seed=t.seed)
    docs = read_documents(cfg.data.data)
    return TokenWindows.from_texts(docs, t.seq_length, tokenizer_dir=cfg.data.tokenizer, source=cfg.data.data,
                                   tokenizer=run_wordpiece(cfg, docs, share, save_dir))


def causal_lm_data(cfg: GalaxyConfig, share: Optional[Callable] = None, save_dir: Optional[str] = None):
    """(batch_at, eval_at, vocab_size) of packed causal-LM windows; ``eval_at`` (None without
    ``eval_every``) reads ``eval_data`` packed with the training data's tokenizer, else the held-out split."""
    t, d = cfg.train, cfg.data
    windows = causal_lm_windows(cfg, share, save_dir)
    batch_at = CausalLMBatcher(windows, t.global_batch_size, seed=t.seed).batch_at
    if not t.eval_every:
        return batch_at, None, windows.vocab_size
    if d.eval_data:
        if not d.data:
            raise ConfigError("config key 'eval_data' needs 'data' (the training file whose tokenizer it shares); "
                              "the synthetic corpus has its own held-out split")
        held_out = TokenWindows.from_texts(read_documents(d.eval_data), t.seq_length, tokenizer_dir=d.tokenizer,
                                           tokenizer=None if d.tokenizer else windows.tokenizer, eval_fraction=0.0,
                                           source=d.eval_data)
        return batch_at, CausalLMBatcher(held_out, t.global_batch_size, seed=t.seed).batch_at, windows.vocab_size
    if windows.num_windows("eval") == 0:
        raise ConfigError(f"config key 'eval_every' needs held-out text but '{d.data}' has too few documents to hold "
                          "one out; add documents or give 'eval_data'")
    return batch_at, CausalLMBatcher(windows, t.global_batch_size, seed=t.seed, split="eval").batch_at, \
        windows.vocab_size


def classification_data(cfg: GalaxyConfig, share: Optional[Callable] = None, save_dir: Optional[str] = None):
    """(batch_at, eval_at, vocab_size) for ``task: classify``: the labelled JSONL ``data``
    (``{"text", "label"}`` lines), tokenized with ``tokenizer`` or a WordPiece trained on its texts;
    held out: ``eval_data``, else the last tenth of the examples."""
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
    texts = [text for text, _ in examples]
    corpus = TextCorpus.from_texts(texts, t.seq_length, tokenizer_dir=d.tokenizer, eval_fraction=0.0, source=d.data,
                                   tokenizer=run_wordpiece(cfg, texts, share, save_dir))
    ids = dict(cls_id=corpus.cls_id, sep_id=corpus.sep_id, pad_id=corpus.pad_id, seed=t.seed)
    train = ClassificationBatcher(examples, corpus.encode, t.seq_length, t.global_batch_size, **ids)
    evals = ClassificationBatcher(held_out, corpus.encode, t.seq_length, t.global_batch_size, **ids) \
        if held_out else None
    return train.batch_at, evals.batch_at if evals else None, corpus.vocab_size
