"""Causal-LM pretraining batches (LLaMA-family pretraining): packed token windows, a pure function of the step.

Packing, as torchtitan, Megatron-LM and nanoGPT do it: every document is tokenized and followed by
one end-of-text id (``eos_id``), the documents are joined in order into one token stream, and the
stream is cut into consecutive windows of ``seq_len`` tokens. A document may run on into the next
window; inside a window causal attention sees the documents before it (no per-document mask), and
the end-of-text id between them is predicted like any token. Labels are the input ids (the model
shifts them: position t predicts t + 1), -100 on padding.

Window sources (what :class:`CausalLMBatcher` reads)::

    seq_len, vocab_size, pad_id, eos_id                # ints
    num_windows(split) -> int | None                   # None: an unbounded (generated) stream
    window(index, split) -> list[int]                  # 1..seq_len tokens

:class:`TokenWindows` packs local text (its last documents held out, by document, before packing,
so no held-out text is in a training window; only a split's last window can be short, padded);
:class:`SyntheticWindows` packs the built-in synthetic documents, every window full.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch

from galaxy.data.batching import IGNORE_INDEX, RowStream, check_int, check_split
from galaxy.data.corpus import SyntheticCorpus, held_out_count
from galaxy.data.tokenizer import check_wordpiece, encode_wordpiece, load_hf_tokenizer, train_wordpiece
from galaxy.errors import DataError

logger = logging.getLogger(__name__)


def pack_stream(documents: Sequence[Sequence[int]], eos_id: int) -> torch.Tensor:
    """``d1 EOS d2 EOS ... dn EOS`` as one LongTensor (empty documents skipped)."""
    parts = [torch.tensor(list(d) + [eos_id], dtype=torch.long) for d in documents if len(d)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class TokenWindows:
    """Tokenized documents packed into ``seq_len`` windows (module doc), a train and an eval split.

    Build with :meth:`from_texts`. The end-of-text id is the tokenizer's EOS (a HF tokenizer
    directory: ``eos_token``, else ``sep_token``; the trained WordPiece: ``[SEP]``), padding its PAD
    (else the EOS id; padded positions carry attention 0 and label -100 whatever the id)."""

    def __init__(self, train: Sequence[Sequence[int]], evals: Sequence[Sequence[int]], *, seq_len: int,
                 vocab_size: int, pad_id: int, eos_id: int, tokenizer: Any = None, source: str = "<texts>") -> None:
        check_int("TokenWindows seq_len", seq_len, 2)
        self.seq_len, self.vocab_size, self.pad_id, self.eos_id = seq_len, vocab_size, pad_id, eos_id
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer (trained WordPiece) or a transformers tokenizer
        self.source = source
        self._streams = {"train": pack_stream(train, eos_id), "eval": pack_stream(evals, eos_id)}
        self.num_documents = {"train": sum(1 for d in train if len(d)), "eval": sum(1 for d in evals if len(d))}
        if not len(self._streams["train"]):
            raise DataError(f"{source}: no document has a token after tokenisation; check the file's text and the "
                            "tokenizer")

    @classmethod
    def from_texts(cls, texts: Sequence[str], seq_len: int, *, tokenizer: Any = None,
                   tokenizer_dir: str | os.PathLike | None = None, vocab_size: int | None = None,
                   eval_fraction: float = 0.1, source: str = "<texts>") -> "TokenWindows":
        """Tokenize ``texts`` with ``tokenizer`` (a WordPiece from :func:`galaxy.data.tokenizer.
        train_wordpiece`, e.g. the run's shared one), the HF tokenizer in ``tokenizer_dir``, or else a
        WordPiece of ``vocab_size`` (default 8000) trained here; the last ``eval_fraction`` of the
        documents form the eval split."""
        if tokenizer is not None and tokenizer_dir is not None:
            raise ValueError("TokenWindows: give a trained tokenizer or a tokenizer_dir, not both")
        if not isinstance(eval_fraction, (int, float)) or not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"TokenWindows eval_fraction must be in [0, 1), got {eval_fraction!r}")
        texts = [t.strip() for t in texts if isinstance(t, str) and t.strip()]
        if not texts:
            raise DataError(f"{source}: no non-empty documents; add at least one document")
        if tokenizer_dir is not None:
            tok = load_hf_tokenizer(tokenizer_dir)
            eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
            if eos is None:
                raise DataError(f"tokenizer in {os.fspath(tokenizer_dir)!r} has no eos (or sep) token; causal-LM "
                                "pretraining ends every document with one; use a tokenizer that defines eos_token")
            pad = tok.pad_token_id if tok.pad_token_id is not None else eos
            encoded = tok(list(texts), add_special_tokens=False)["input_ids"]
            vocab = len(tok)
        else:
            tok = tokenizer if tokenizer is not None else train_wordpiece(texts, vocab_size or 8000)
            check_wordpiece(tok)
            eos, pad = tok.token_to_id("[SEP]"), tok.token_to_id("[PAD]")
            encoded = encode_wordpiece(tok, texts)
            vocab = tok.get_vocab_size()
        cut = len(encoded) - held_out_count(len(encoded), eval_fraction)
        windows = cls(encoded[:cut], encoded[cut:], seq_len=seq_len, vocab_size=vocab, pad_id=pad, eos_id=eos,
                      tokenizer=tok, source=source)
        logger.info("TokenWindows %s: %d documents -> %d train / %d eval windows of %d tokens (vocab %d)", source,
                    len(encoded), windows.num_windows("train"), windows.num_windows("eval"), seq_len, vocab)
        return windows

    def num_windows(self, split: str = "train") -> int:
        return -(-len(self._streams[check_split(split)]) // self.seq_len)

    def window(self, index: int, split: str = "train") -> list[int]:
        n = self.num_windows(split)
        if not 0 <= index < n:
            raise ValueError(f"window index {index} out of range for the {split} split ({n} windows)")
        return self._streams[split][index * self.seq_len:(index + 1) * self.seq_len].tolist()

    def __repr__(self) -> str:
        return (f"TokenWindows({self.source!r}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
                f"train={self.num_windows('train')}, eval={self.num_windows('eval')})")


class SyntheticWindows:
    """The synthetic corpus's documents (:class:`galaxy.data.corpus.SyntheticCorpus`: phrases,
    arithmetic runs, noise; ``seq_len // 2`` to ``seq_len`` tokens each) packed into full windows.

    Both splits are unbounded. Window ``i`` packs fresh documents ``i*K, i*K+1, ...`` of the split
    (``K`` = the most that can start in one window), each followed by ``eos_id``, and is cut at
    ``seq_len``; the rest of its last document is dropped, so a window is a pure function of
    ``(seed, split, i)`` without generating the windows before it. Ids as the synthetic corpus's:
    0 ``[PAD]``, 3 ``[SEP]`` as the end-of-text id, content from 5 up."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0) -> None:
        self.corpus = SyntheticCorpus(vocab_size, seq_len, seed=seed)
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.pad_id, self.eos_id = self.corpus.pad_id, self.corpus.sep_id
        shortest = max(4, seq_len // 2) - 2 + 1  # the fewest content tokens of a document, and its EOS
        self._per_window = -(-seq_len // shortest)

    def num_windows(self, split: str = "train") -> None:
        check_split(split)
        return None

    def documents(self, index: int, split: str = "train") -> list[list[int]]:
        """The documents (content ids, without the end-of-text id) window ``index`` starts from."""
        check_int("window index", index, 0)
        docs, used = [], 0
        for k in range(self._per_window):
            if used >= self.seq_len:
                break
            doc = self.corpus.get_sequence(index * self._per_window + k, split)[1:-1]  # drop [CLS] ... [SEP]
            docs.append(doc)
            used += len(doc) + 1
        return docs

    def window(self, index: int, split: str = "train") -> list[int]:
        return pack_stream(self.documents(index, split), self.eos_id)[:self.seq_len].tolist()

    def __repr__(self) -> str:
        return f"SyntheticWindows(vocab_size={self.vocab_size}, seq_len={self.seq_len}, seed={self.seed})"


class CausalLMBatcher:
    """Causal-LM batches that are a pure function of the step.

    ``batch_at(step)`` takes windows ``step*B .. step*B+B-1`` of the split's window stream (a finite
    split visited epoch by epoch, each epoch in a permutation seeded by ``(seed, split, epoch)``; an
    unbounded one in order; :class:`galaxy.data.batching.RowStream`), each right-padded to
    ``seq_len``. A data-parallel shard ``(dp_rank, dp_size)`` builds only its contiguous rows, so the
    shards concatenate to exactly the global batch."""

    def __init__(self, source: Any, global_batch_size: int, seed: int = 0, split: str = "train") -> None:
        for attr in ("seq_len", "vocab_size", "pad_id", "eos_id", "num_windows", "window"):
            if not hasattr(source, attr):
                raise ValueError(f"CausalLMBatcher source {type(source).__name__} has no attribute {attr!r}; use "
                                 "TokenWindows or SyntheticWindows")
        check_int("CausalLMBatcher seed", seed, 0)
        self.source, self.global_batch_size, self.seed = source, global_batch_size, seed
        self.split = check_split(split)
        self.seq_len = source.seq_len
        self.num_windows = source.num_windows(split)
        if self.num_windows == 0:
            raise ValueError(f"CausalLMBatcher: the source has no {split!r} windows; add documents or give a "
                             "held-out file")
        self._rows = RowStream(self.num_windows, global_batch_size, seed, "causal-order", split,
                               who=f"CausalLMBatcher ({split} windows)")

    @property
    def steps_per_epoch(self) -> int | None:
        return self._rows.steps_per_epoch

    def window_index(self, step: int, row: int) -> int:
        """Index (within the split) of the window in global row ``row`` of ``step``."""
        return self._rows(step, row)

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` (1 real / 0 pad) and ``labels`` (the input ids, -100 on
        padding), LongTensors ``[rows, seq_len]``; rows = the global batch, or shard ``(dp_rank, dp_size)``'s."""
        lo, hi, items = self._rows.rows(step, shard)
        ids = torch.full((hi - lo, self.seq_len), self.source.pad_id, dtype=torch.long)
        attention = torch.zeros((hi - lo, self.seq_len), dtype=torch.long)
        for out, index in enumerate(items):
            window = self.source.window(index, self.split)
            ids[out, :len(window)] = torch.tensor(window, dtype=torch.long)
            attention[out, :len(window)] = 1
        labels = torch.where(attention.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}

    def __repr__(self) -> str:
        return (f"CausalLMBatcher({self.source!r}, global_batch_size={self.global_batch_size}, seed={self.seed}, "
                f"split={self.split!r})")
