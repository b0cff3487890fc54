"""What ``compare_tuning.py`` fine-tunes on: a pretrained base (given, or pretrained once and cached)
and a downstream task with held-out data.

A masked LM (BERT): the base is pretrained on unlabelled text; the task is sequence classification
(``--data``: a JSONL of ``{"text", "label"}`` lines, else a generated topic-classification set whose
unlabelled documents the base was pretrained on), measured by held-out accuracy. A causal LM (LLaMA):
the base is pretrained on the training examples' text; the task is instruction tuning on the Alpaca-style
data (``--data``, else the shipped sample), measured by held-out loss and perplexity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from typing import Callable, Optional

import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.data.batching import IGNORE_INDEX
from galaxy.data.tokenizer import TOKENIZER_FILE, default_tokenizer_cache

logger = logging.getLogger(__name__)

# -- the generated topic-classification task: documents mix filler words with words of their topic

TOPICS = 4
_SYLLABLES = ("ka", "lo", "mi", "ru", "te", "zo", "pa", "ne", "si", "vu", "da", "fo", "gi", "hu", "be", "co")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def topic_documents(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (text, topic) pairs: 12-28 words each, about a third from the topic's own 24 words, one in
    twenty from another topic's, the rest from 120 shared filler words (one fixed lexicon for every seed)."""
    lexicon = random.Random(1234)
    filler = [_word(lexicon) for _ in range(120)]
    topics = [[_word(lexicon) + str(t) for _ in range(24)] for t in range(TOPICS)]
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        label = rng.randrange(TOPICS)
        words = []
        for _ in range(rng.randint(12, 28)):
            draw = rng.random()
            if draw < 0.33:
                words.append(rng.choice(topics[label]))
            elif draw < 0.38:
                words.append(rng.choice(topics[rng.randrange(TOPICS)]))
            else:
                words.append(rng.choice(filler))
        docs.append((" ".join(words), label))
    return docs


def write_topic_task(directory: str, n_train: int = 256, n_eval: int = 128, seed: int = 0) -> tuple[str, str]:
    """The generated task as two JSONL files (train, held out) in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for split, n, s in (("train", n_train, seed + 1), ("eval", n_eval, seed + 2)):
        path = os.path.join(directory, f"topics_{split}.jsonl")
        with open(path, "w") as f:
            for text, label in topic_documents(n, s):
                f.write(json.dumps({"text": text, "label": label}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


# -- the pretrained base


def default_cache() -> str:
    return os.path.join(os.path.dirname(default_tokenizer_cache()), "compare_bases")


def _fingerprint(cfg: GalaxyConfig, steps: int, texts: list[str]) -> str:
    h = hashlib.sha256(json.dumps({"model": cfg.to_dict()["model"], "steps": steps, "seed": cfg.train.seed,
                                   "lr": cfg.train.lr, "batch": cfg.train.global_batch_size,
                                   "seq": cfg.train.seq_length}, sort_keys=True).encode())
    for text in texts:
        h.update(text.encode())
    return h.hexdigest()[:24]


def pretrained_base(cfg: GalaxyConfig, texts: list[str], steps: int, cache_dir: Optional[str]) -> tuple[str, bool]:
    """A base model pretrained here once on ``texts`` (BERT: masked LM with a WordPiece trained on them;
    LLaMA: causal LM with the byte tokenizer) for ``steps`` steps, on one rank, and cached under
    ``cache_dir`` by a fingerprint of the model, the settings and the texts; returns its HF directory and
    whether it was trained now (False: an earlier run's)."""
    from galaxy.data.corpus import TextCorpus
    from galaxy.data.mlm import MLMBatcher
    from galaxy.data.tokenizer import save_wordpiece, train_wordpiece
    from galaxy.models import build_model, family
    from galaxy.train.loop import train

    directory = os.path.join(cache_dir or default_cache(), _fingerprint(cfg, steps, texts))
    if os.path.isfile(os.path.join(directory, "model.safetensors")):
        return directory, False
    base = GalaxyConfig.from_dict(cfg.to_dict())
    base.parallel.plan, base.peft.tuning, base.data.model_path = "none", "full", None
    base.train.max_steps, base.train.eval_every = steps, 0
    ctx = ParallelContext.serial(seed=base.train.seed)
    if not family(base.model.model_type).causal:  # a masked LM, with a WordPiece trained on the texts
        tok = train_wordpiece(texts, base.model.vocab_size)
        base.model.vocab_size = tok.get_vocab_size()
        corpus = TextCorpus.from_texts(texts, base.train.seq_length, tokenizer=tok, eval_fraction=0.0)
        batch_at = MLMBatcher(corpus, base.train.global_batch_size, seed=base.train.seed).batch_at
    else:
        tok = None
        batch_at = causal_lm_batches(texts, base)
    model = build_model(base, base.resolve_plan(1), ctx)
    result = train(model, batch_at, base, ctx)
    logger.info("pretrained base: loss %.3f -> %.3f in %d steps", result.losses[0], result.losses[-1], steps)
    partial = f"{directory}.{os.getpid()}.tmp"
    model.save_pretrained(partial)
    if tok is not None:
        save_wordpiece(tok, partial)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    os.replace(partial, directory)
    return directory, True


def causal_lm_batches(texts: list[str], cfg: GalaxyConfig) -> Callable[..., dict]:
    """Byte-level causal-LM batches over ``texts`` (every real token a target), a pure function of the step."""
    from galaxy.data.batching import EpochPermutation, shard_bounds
    from galaxy.data.tokenizer import ByteTokenizer

    tok, t = ByteTokenizer(), cfg.train
    rows = [([tok.bos_id] + tok.encode(text) + [tok.eos_id])[:t.seq_length] for text in texts]
    order = EpochPermutation(len(rows), t.seed, "causal-lm")

    def batch_at(step: int, shard: Optional[tuple[int, int]] = None) -> dict:
        lo, hi = shard_bounds(t.global_batch_size, shard)
        picked = [rows[order(step * t.global_batch_size + r)] for r in range(t.global_batch_size)]
        width = max(len(r) for r in picked)
        ids = torch.full((hi - lo, width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for out, row in enumerate(picked[lo:hi]):
            ids[out, :len(row)], mask[out, :len(row)] = torch.tensor(row), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}

    return batch_at


def load_base(model: torch.nn.Module, directory: str) -> list[str]:
    """Copy the base checkpoint's weights into ``model``; the task's own head (absent from a pretraining
    checkpoint, whose pretraining head is left out) keeps its fresh initialisation, as ``transformers``
    does. Returns the names left fresh."""
    from galaxy.models.base import load_weights

    own = {name for name, _ in model.named_parameters()}
    state = {k: v for k, v in model.state_from_hf(load_weights(directory)).items() if k in own}
    return model.load_full_state_dict(state, source=f"base '{directory}'", keep_fresh=model.fresh_for_task)


def base_tokenizer(directory: str):
    """The WordPiece saved beside a base pretrained here, or the HF tokenizer of a given base."""
    from tokenizers import Tokenizer

    path = os.path.join(directory, TOKENIZER_FILE)
    return Tokenizer.from_file(path) if os.path.isfile(path) else None
