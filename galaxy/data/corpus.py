"""Masked-LM corpora: the built-in synthetic stream and local text files packed into sequences.

Corpus protocol (what :class:`galaxy.data.mlm.MLMBatcher` needs; both corpora implement it)::

    vocab_size, seq_len, pad_id, unk_id, cls_id, sep_id, mask_id   # ints
    special_ids                                                   # frozenset[int]
    num_sequences(split) -> int | None     # None: an unbounded (generated) stream
    get_sequence(index, split) -> list[int]  # [CLS] ... [SEP], 3 <= len <= seq_len, unpadded
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Sequence

import torch

from galaxy.data.batching import check_int, check_split, seeded_generator
from galaxy.data.tokenizer import (SPECIAL_TOKENS, check_wordpiece, encode_wordpiece, load_hf_tokenizer,
                                   save_wordpiece, train_wordpiece)
from galaxy.errors import DataError

logger = logging.getLogger(__name__)

_PAD, _UNK, _CLS, _SEP, _MASK = range(len(SPECIAL_TOKENS))


class SyntheticCorpus:
    """Token sequences with learnable structure, generated on the fly from ``(seed, split, index)``.

    A fixed random set of ``num_phrases`` "phrases" (3-6 content tokens each) is drawn once from
    ``seed``. Each sequence is ``[CLS] content [SEP]`` with a real length uniform in
    ``[max(4, seq_len // 2), seq_len]`` (so rows are padded and attention masks matter); the
    content is a chain of segments: a phrase copied verbatim (60%), an arithmetic-progression run
    ``a, a+d, a+2d, ...`` over the content ids with ``d`` in {1, 2, 3} (30%), or one uniformly random
    token (10%, noise). A masked token inside a phrase or a run is predictable from its neighbours,
    and the skewed unigram distribution alone lets MLM loss fall fast from ``ln(vocab_size)``.

    Ids ``0..4`` are ``[PAD] [UNK] [CLS] [SEP] [MASK]``; ids ``5..num_special-1`` are reserved and
    never emitted; content ids are ``num_special..vocab_size-1``. Both splits are unbounded
    streams (``num_sequences`` returns None) drawn from independent seed streams; they share the
    phrase set (same distribution) but not the sequences.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int = 0,
        num_special: int = 5,
        num_phrases: int = 32,
    ) -> None:
        check_int("SyntheticCorpus num_special", num_special, 5)
        check_int("SyntheticCorpus vocab_size", vocab_size, num_special + 8)
        check_int("SyntheticCorpus seq_len", seq_len, 4)
        check_int("SyntheticCorpus seed", seed, 0)
        check_int("SyntheticCorpus num_phrases", num_phrases, 1)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_special = num_special
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = _PAD, _UNK, _CLS, _SEP, _MASK
        self.special_ids = frozenset(range(num_special))
        self._num_content = vocab_size - num_special
        self._min_len = max(4, seq_len // 2)

        gen = seeded_generator(seed, "synthetic-phrases")
        lengths = torch.randint(3, 7, (num_phrases,), generator=gen).tolist()
        self.phrases: list[list[int]] = [
            (torch.randint(0, self._num_content, (n,), generator=gen) + num_special).tolist()
            for n in lengths
        ]
        logger.debug(
            "SyntheticCorpus(vocab_size=%d, seq_len=%d, seed=%d): %d phrases",
            vocab_size, seq_len, seed, num_phrases,
        )

    def num_sequences(self, split: str = "train") -> int | None:
        check_split(split)
        return None

    def get_sequence(self, index: int, split: str = "train") -> list[int]:
        check_split(split)
        check_int("sequence index", index, 0)
        # Enough uniforms for the worst case: at most 4 per segment, at most one segment per token.
        u = iter(torch.rand(4 * self.seq_len + 4, generator=seeded_generator(
            self.seed, "synthetic-seq", split, index)).tolist())
        real_len = self._min_len + min(int(next(u) * (self.seq_len - self._min_len + 1)),
                                       self.seq_len - self._min_len)
        n_content = real_len - 2
        c, base = self._num_content, self.num_special
        content: list[int] = []
        while len(content) < n_content:
            kind = next(u)
            if kind < 0.6:
                content.extend(self.phrases[min(int(next(u) * len(self.phrases)), len(self.phrases) - 1)])
            elif kind < 0.9:
                start = min(int(next(u) * c), c - 1)
                step = 1 + min(int(next(u) * 3), 2)
                run = 3 + min(int(next(u) * 4), 3)
                content.extend(base + (start + k * step) % c for k in range(run))
            else:
                content.append(base + min(int(next(u) * c), c - 1))
        return [self.cls_id] + content[:n_content] + [self.sep_id]

    def __repr__(self) -> str:
        return (f"SyntheticCorpus(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
                f"seed={self.seed}, num_special={self.num_special})")


def read_documents(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise DataError(
            f"text corpus file not found: {path!r}; pass an existing .txt (one document per line) "
            f"or .jsonl (one {{\"text\": ...}} object per line) file"
        )
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".txt", ".jsonl"):
        raise DataError(
            f"text corpus file {path!r} has unsupported extension {ext!r}; use .txt (one document "
            f"per line) or .jsonl (one {{\"text\": ...}} object per line)"
        )
    logger.info("reading %s (%.1f MB)", path, os.path.getsize(path) / 2**20)
    docs: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:  # line by line: one copy of the text, however it is cut
            for lineno, line in enumerate(line for read in f for line in read.splitlines()):
                _add_document(docs, line, ext, path, lineno + 1)
    except UnicodeDecodeError as e:
        raise DataError(f"text corpus file {path!r} is not valid UTF-8 ({e}); re-encode it as UTF-8") from None
    if not docs:
        raise DataError(f"text corpus file {path!r} contains no documents (it is empty or every "
                        f"line is blank); add at least one non-empty document")
    logger.info("%s: %d documents, the longest %d characters", path, len(docs), max(map(len, docs)))
    return docs


def _add_document(docs: list[str], line: str, ext: str, path: str, lineno: int) -> None:
    """The document of one line of a .txt or .jsonl corpus, appended to ``docs`` (none for a blank line)."""
    if not line.strip():
        return
    if ext == ".txt":
        docs.append(line.strip())
        return
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each .jsonl line must be "
                        f"an object like {{\"text\": \"...\"}}") from None
    if not isinstance(obj, dict) or "text" not in obj:
        raise DataError(f"{path}:{lineno}: JSON line has no 'text' field; each .jsonl line must "
                        f"be an object like {{\"text\": \"...\"}}")
    if not isinstance(obj["text"], str):
        raise DataError(f"{path}:{lineno}: field 'text' must be a string, got "
                        f"{type(obj['text']).__name__}")
    if obj["text"].strip():
        docs.append(obj["text"].strip())


def held_out_count(num_documents: int, eval_fraction: float) -> int:
    """How many of the last documents form the held-out split: ``eval_fraction`` of them, rounded, at
    least one when ``eval_fraction > 0`` and at most all but one (none of a single document)."""
    if num_documents < 2 or eval_fraction <= 0:
        return 0
    return min(max(1, int(round(num_documents * eval_fraction))), num_documents - 1)


def pack_documents(
    docs: list[list[int]], seq_len: int, cls_id: int, sep_id: int, special_ids: frozenset[int]
) -> list[list[int]]:
    """Greedy packing: ``[CLS] d1 [SEP] d2 [SEP] ...`` while whole documents fit in ``seq_len``;
    a document longer than ``seq_len - 2`` is cut into consecutive chunks. Chunks with no
    non-special token (nothing to mask) are dropped."""
    budget = seq_len - 2
    pieces = [doc[k:k + budget] for doc in docs for k in range(0, len(doc), budget)]
    pieces = [p for p in pieces if any(t not in special_ids for t in p)]
    sequences: list[list[int]] = []
    current: list[int] = []
    for piece in pieces:
        if current and len(current) + 1 + len(piece) <= budget:
            current.extend([sep_id] + piece)
            continue
        if current:
            sequences.append([cls_id] + current + [sep_id])
        current = list(piece)
    if current:
        sequences.append([cls_id] + current + [sep_id])
    return sequences


class TextCorpus:
    """Tokenised documents packed into ``[CLS] ... [SEP]`` sequences of at most ``seq_len`` tokens.

    Build with :meth:`from_file` (or :meth:`from_texts`). The last ``eval_fraction`` of the
    documents (at least one when there are two or more) form the ``'eval'`` split; the split is by
    document, before packing, so no eval text appears in a train sequence.
    """

    def __init__(
        self,
        train_sequences: list[list[int]],
        eval_sequences: list[list[int]],
        *,
        seq_len: int,
        vocab_size: int,
        pad_id: int,
        unk_id: int,
        cls_id: int,
        sep_id: int,
        mask_id: int,
        special_ids: Iterable[int],
        tokenizer: Any = None,
        source: str = "<texts>",
    ) -> None:
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = pad_id, unk_id, cls_id, sep_id, mask_id
        self.special_ids = frozenset(special_ids) | {pad_id, cls_id, sep_id, mask_id}
        #: a ``tokenizers.Tokenizer`` (trained WordPiece) or a ``transformers`` tokenizer
        self.tokenizer = tokenizer
        self.source = source
        self._sequences = {"train": train_sequences, "eval": eval_sequences}

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        seq_len: int,
        tokenizer_dir: str | os.PathLike | None = None,
        vocab_size: int | None = None,
        eval_fraction: float = 0.1,
        tokenizer: Any = None,
    ) -> "TextCorpus":
        """Read ``.txt`` (one document per line) or ``.jsonl`` (field ``text``) and tokenise it with
        ``tokenizer`` (a WordPiece from :func:`galaxy.data.tokenizer.train_wordpiece`, e.g. the one
        trained once for the run), the HF tokenizer in ``tokenizer_dir``, or, when neither is given, a
        WordPiece of ``vocab_size`` (default 8000) trained here on the file."""
        path = os.fspath(path)
        docs = read_documents(path)
        return cls.from_texts(docs, seq_len, tokenizer_dir=tokenizer_dir, vocab_size=vocab_size,
                              eval_fraction=eval_fraction, source=path, tokenizer=tokenizer)

    @classmethod
    def from_texts(
        cls,
        texts: Sequence[str],
        seq_len: int,
        tokenizer_dir: str | os.PathLike | None = None,
        vocab_size: int | None = None,
        eval_fraction: float = 0.1,
        source: str = "<texts>",
        tokenizer: Any = None,
    ) -> "TextCorpus":
        check_int("TextCorpus seq_len", seq_len, 3)
        if not isinstance(eval_fraction, (int, float)) or not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"TextCorpus eval_fraction must be in [0, 1), got {eval_fraction!r}")
        texts = [t.strip() for t in texts if isinstance(t, str) and t.strip()]
        if not texts:
            raise ValueError(f"TextCorpus {source}: no non-empty documents; add at least one document")

        if tokenizer is not None and tokenizer_dir is not None:
            raise ValueError("TextCorpus: give a trained tokenizer or a tokenizer_dir, not both")
        if tokenizer_dir is not None:
            if vocab_size is not None:
                logger.warning("TextCorpus: vocab_size=%s ignored, the tokenizer in %s fixes the vocabulary",
                               vocab_size, tokenizer_dir)
            tok = load_hf_tokenizer(tokenizer_dir)
            ids = {}
            for name in ("pad", "cls", "sep", "mask"):
                tid = getattr(tok, f"{name}_token_id", None)
                if tid is None:
                    raise DataError(
                        f"tokenizer in {os.fspath(tokenizer_dir)!r} has no {name} token; masked-LM "
                        f"data needs pad, cls, sep and mask tokens (use a BERT-style tokenizer)"
                    )
                ids[name] = tid
            unk = tok.unk_token_id if tok.unk_token_id is not None else ids["pad"]
            special = set(tok.all_special_ids)
            encoded = tok(list(texts), add_special_tokens=False)["input_ids"]
            vocab = len(tok)
        else:
            tok = tokenizer if tokenizer is not None else train_wordpiece(texts, vocab_size or 8000)
            check_wordpiece(tok)
            ids = {"pad": _PAD, "cls": _CLS, "sep": _SEP, "mask": _MASK}
            unk = _UNK
            special = set(range(len(SPECIAL_TOKENS)))
            encoded = encode_wordpiece(tok, texts)
            vocab = tok.get_vocab_size()

        n_eval = held_out_count(len(encoded), eval_fraction)
        special_f = frozenset(special) | {unk}
        train_docs, eval_docs = encoded[:len(encoded) - n_eval], encoded[len(encoded) - n_eval:]
        train = pack_documents(train_docs, seq_len, ids["cls"], ids["sep"], special_f)
        evals = pack_documents(eval_docs, seq_len, ids["cls"], ids["sep"], special_f)
        if not train:
            raise DataError(f"TextCorpus {source}: no document has a non-special token after "
                            f"tokenisation; check the file's text and the tokenizer")
        logger.info("TextCorpus %s: %d documents -> %d train / %d eval sequences (seq_len=%d, vocab=%d)",
                    source, len(encoded), len(train), len(evals), seq_len, vocab)
        return cls(train, evals, seq_len=seq_len, vocab_size=vocab, pad_id=ids["pad"], unk_id=unk,
                   cls_id=ids["cls"], sep_id=ids["sep"], mask_id=ids["mask"], special_ids=special_f,
                   tokenizer=tok, source=source)

    # -- corpus protocol -----------------------------------------------------------------------

    def num_sequences(self, split: str = "train") -> int:
        return len(self._sequences[check_split(split)])

    def get_sequence(self, index: int, split: str = "train") -> list[int]:
        seqs = self._sequences[check_split(split)]
        if not 0 <= index < len(seqs):
            raise ValueError(f"sequence index {index} out of range for the {split} split "
                             f"({len(seqs)} sequences)")
        return list(seqs[index])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens, with this corpus's tokenizer."""
        if hasattr(self.tokenizer, "encode_batch"):  # a trained tokenizers.Tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def save_tokenizer(self, directory: str | os.PathLike) -> None:
        """Save the tokenizer as a HF directory, loadable with ``tokenizer_dir=`` (and by
        ``transformers.AutoTokenizer``), so later runs reuse the exact vocabulary."""
        if hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(os.fspath(directory))
        else:
            save_wordpiece(self.tokenizer, directory)

    def __repr__(self) -> str:
        return (f"TextCorpus({self.source!r}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
                f"train={self.num_sequences('train')}, eval={self.num_sequences('eval')})")
