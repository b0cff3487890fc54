"""Deterministic, offline data for Galaxy.

Two families live here:

* **Masked-LM pretraining (BERT)**: a corpus (:class:`SyntheticCorpus` or :class:`TextCorpus`)
  and :class:`MLMBatcher`, whose ``batch_at(step)`` is a pure function of
  ``(corpus, seed, split, global_batch_size, mlm_probability, step)``. Every rank and every process
  computes the same global batch, data-parallel ranks take contiguous row slices of it
  (``shard=(dp_rank, dp_size)``), and resuming from a step is exact because nothing depends on
  how many batches were drawn before.
* **Instruction tuning (LLaMA)**: :func:`load_instruction_data` (Alpaca JSON / JSONL),
  :class:`ByteTokenizer` (offline fallback) or :class:`HFTokenizer` (a local HF directory), and
  :class:`InstructionBatcher`, deterministic by step in the same way.

Corpus protocol (what :class:`MLMBatcher` needs; both corpora implement it)::

    vocab_size, seq_len, pad_id, unk_id, cls_id, sep_id, mask_id   # ints
    special_ids                                                   # frozenset[int]
    num_sequences(split) -> int | None     # None: an unbounded (generated) stream
    get_sequence(index, split) -> list[int]  # [CLS] ... [SEP], 3 <= len <= seq_len, unpadded

Randomness never touches the global RNGs: every draw comes from a fresh ``torch.Generator``
seeded with a stable hash of a tuple such as ``(seed, "mlm", split, step)``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "SPECIAL_TOKENS",
    "SyntheticCorpus",
    "TextCorpus",
    "MLMBatcher",
    "ALPACA_PROMPT_WITH_INPUT",
    "ALPACA_PROMPT_NO_INPUT",
    "format_prompt",
    "load_instruction_data",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "InstructionBatcher",
]

#: Compact special-token layout shared by SyntheticCorpus and the WordPiece trained by TextCorpus.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_PAD, _UNK, _CLS, _SEP, _MASK = range(5)

_SPLITS = ("train", "eval")
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from a tuple of ints/strings (same in every process and platform)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(*parts: Any) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_derive_seed(*parts))
    return gen


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_split(split: str) -> str:
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split


def _shard_bounds(global_batch_size: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    """Contiguous rows [lo, hi) of the global batch owned by data-parallel shard (rank, size)."""
    if shard is None:
        return 0, global_batch_size
    try:
        dp_rank, dp_size = shard
    except (TypeError, ValueError):
        raise ValueError(f"shard must be a (dp_rank, dp_size) pair, got {shard!r}") from None
    _check_int("shard dp_size", dp_size, 1)
    _check_int("shard dp_rank", dp_rank, 0)
    if dp_rank >= dp_size:
        raise ValueError(f"shard dp_rank={dp_rank} must be < dp_size={dp_size}")
    if global_batch_size % dp_size != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}; "
            f"choose a global batch size that is a multiple of the data-parallel size"
        )
    per = global_batch_size // dp_size
    return dp_rank * per, (dp_rank + 1) * per


class _EpochPermutation:
    """Maps a global row position to an item index: epoch e visits all items in a permutation
    seeded by (tag..., e). Keeps the two most recent permutations (a batch may straddle epochs)."""

    def __init__(self, num_items: int, *tag: Any) -> None:
        self.num_items = num_items
        self._tag = tag
        self._cache: dict[int, list[int]] = {}

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_items)
        perm = self._cache.get(epoch)
        if perm is None:
            perm = torch.randperm(self.num_items, generator=_generator(*self._tag, epoch)).tolist()
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm[offset]


# ----------------------------------------------------------------------------------------------
# synthetic corpus
# ----------------------------------------------------------------------------------------------


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
        _check_int("SyntheticCorpus num_special", num_special, 5)
        _check_int("SyntheticCorpus vocab_size", vocab_size, num_special + 8)
        _check_int("SyntheticCorpus seq_len", seq_len, 4)
        _check_int("SyntheticCorpus seed", seed, 0)
        _check_int("SyntheticCorpus num_phrases", num_phrases, 1)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_special = num_special
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = _PAD, _UNK, _CLS, _SEP, _MASK
        self.special_ids = frozenset(range(num_special))
        self._num_content = vocab_size - num_special
        self._min_len = max(4, seq_len // 2)

        gen = _generator(seed, "synthetic-phrases")
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
        _check_split(split)
        return None

    def get_sequence(self, index: int, split: str = "train") -> list[int]:
        _check_split(split)
        _check_int("sequence index", index, 0)
        # Enough uniforms for the worst case: at most 4 per segment, at most one segment per token.
        u = iter(torch.rand(4 * self.seq_len + 4, generator=_generator(
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


# ----------------------------------------------------------------------------------------------
# text corpus + deterministic WordPiece training
# ----------------------------------------------------------------------------------------------


def _read_documents(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise ValueError(
            f"text corpus file not found: {path!r}; pass an existing .txt (one document per line) "
            f"or .jsonl (one {{\"text\": ...}} object per line) file"
        )
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".txt", ".jsonl"):
        raise ValueError(
            f"text corpus file {path!r} has unsupported extension {ext!r}; use .txt (one document "
            f"per line) or .jsonl (one {{\"text\": ...}} object per line)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"text corpus file {path!r} is not valid UTF-8 ({e}); re-encode it as UTF-8") from None
    docs: list[str] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if ext == ".txt":
            docs.append(line.strip())
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg}); each .jsonl line must be "
                             f"an object like {{\"text\": \"...\"}}") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise ValueError(f"{path}:{lineno}: JSON line has no 'text' field; each .jsonl line must "
                             f"be an object like {{\"text\": \"...\"}}")
        if not isinstance(obj["text"], str):
            raise ValueError(f"{path}:{lineno}: field 'text' must be a string, got "
                             f"{type(obj['text']).__name__}")
        if obj["text"].strip():
            docs.append(obj["text"].strip())
    if not docs:
        raise ValueError(f"text corpus file {path!r} contains no documents (it is empty or every "
                         f"line is blank); add at least one non-empty document")
    return docs


def _bert_pipeline():
    from tokenizers import normalizers, pre_tokenizers

    return normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()


def _train_wordpiece_vocab(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> dict[str, int]:
    """Learn a BERT-style WordPiece vocabulary, deterministically.

    ``tokenizers.trainers.WordPieceTrainer`` breaks count ties in hash-map order, so two processes
    training on the same file get different vocabularies (verified with tokenizers 0.23) -- fatal
    when every rank trains its own. This is the same algorithm (BPE merges with the ``##``
    continuation prefix, then WordPiece greedy longest-match at encode time) with ties broken by
    the pair's strings. Normalisation and pre-tokenisation are the ``tokenizers`` Bert ones.
    """
    normalizer, pre_tokenizer = _bert_pipeline()
    word_freq: Counter[str] = Counter()
    for text in texts:
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)):
            word_freq[word] += 1

    words = sorted(word_freq)
    freqs = [word_freq[w] for w in words]
    symbols = [[w[0]] + ["##" + ch for ch in w[1:]] for w in words]

    # Alphabet: every initial/continuation character, most frequent first if it must be cut.
    alpha_freq: Counter[str] = Counter()
    for syms, f in zip(symbols, freqs):
        for s in syms:
            alpha_freq[s] += f
    budget = vocab_size - len(SPECIAL_TOKENS)
    alphabet = sorted(alpha_freq, key=lambda s: (-alpha_freq[s], s))
    if len(alphabet) > budget:
        logger.warning("WordPiece: %d distinct characters exceed vocab_size=%d; the %d rarest "
                       "become [UNK]", len(alphabet), vocab_size, len(alphabet) - budget)
        alphabet = alphabet[:budget]
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for s in sorted(alphabet):
        vocab[s] = len(vocab)
    known = set(alphabet)
    # Words containing a character outside the alphabet encode as [UNK]; they take no part in merges.
    live = [i for i, syms in enumerate(symbols) if all(s in known for s in syms)]

    pair_count: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}
    for i in live:
        syms = symbols[i]
        for pair in zip(syms, syms[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + freqs[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)

    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        count = pair_count.get(pair, 0)
        if count != -neg:
            continue  # stale heap entry
        if count < min_frequency:
            break
        a, b = pair
        merged = a + b[2:]
        if merged not in vocab:
            vocab[merged] = len(vocab)
        touched: dict[tuple[str, str], None] = {}
        for i in sorted(where.pop(pair, ())):
            old = symbols[i]
            new: list[str] = []
            k = 0
            while k < len(old):
                if k + 1 < len(old) and old[k] == a and old[k + 1] == b:
                    new.append(merged)
                    k += 2
                else:
                    new.append(old[k])
                    k += 1
            if len(new) == len(old):
                continue
            f = freqs[i]
            for p in zip(old, old[1:]):
                pair_count[p] -= f
                touched[p] = None
            for p in zip(new, new[1:]):
                pair_count[p] = pair_count.get(p, 0) + f
                where.setdefault(p, set()).add(i)
                touched[p] = None
            symbols[i] = new
        pair_count.pop(pair, None)
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    return vocab


def _wordpiece_tokenizer(vocab: dict[str, int]):
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer, tok.pre_tokenizer = _bert_pipeline()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _pack_documents(
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
    ) -> "TextCorpus":
        """Read ``.txt`` (one document per line) or ``.jsonl`` (field ``text``) and tokenise it with
        the HF tokenizer in ``tokenizer_dir`` (offline) or, when None, with a WordPiece of
        ``vocab_size`` (default 8000) trained deterministically on the file."""
        path = os.fspath(path)
        docs = _read_documents(path)
        return cls.from_texts(docs, seq_len, tokenizer_dir=tokenizer_dir, vocab_size=vocab_size,
                              eval_fraction=eval_fraction, source=path)

    @classmethod
    def from_texts(
        cls,
        texts: Sequence[str],
        seq_len: int,
        tokenizer_dir: str | os.PathLike | None = None,
        vocab_size: int | None = None,
        eval_fraction: float = 0.1,
        source: str = "<texts>",
    ) -> "TextCorpus":
        _check_int("TextCorpus seq_len", seq_len, 3)
        if not isinstance(eval_fraction, (int, float)) or not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"TextCorpus eval_fraction must be in [0, 1), got {eval_fraction!r}")
        texts = [t.strip() for t in texts if isinstance(t, str) and t.strip()]
        if not texts:
            raise ValueError(f"TextCorpus {source}: no non-empty documents; add at least one document")

        if tokenizer_dir is not None:
            if vocab_size is not None:
                logger.warning("TextCorpus: vocab_size=%s ignored, the tokenizer in %s fixes the vocabulary",
                               vocab_size, tokenizer_dir)
            tok = _load_hf_tokenizer(tokenizer_dir)
            ids = {}
            for name in ("pad", "cls", "sep", "mask"):
                tid = getattr(tok, f"{name}_token_id", None)
                if tid is None:
                    raise ValueError(
                        f"tokenizer in {os.fspath(tokenizer_dir)!r} has no {name} token; masked-LM "
                        f"data needs pad, cls, sep and mask tokens (use a BERT-style tokenizer)"
                    )
                ids[name] = tid
            unk = tok.unk_token_id if tok.unk_token_id is not None else ids["pad"]
            special = set(tok.all_special_ids)
            encoded = tok(list(texts), add_special_tokens=False)["input_ids"]
            vocab = len(tok)
        else:
            if vocab_size is None:
                vocab_size = 8000
            _check_int("TextCorpus vocab_size", vocab_size, len(SPECIAL_TOKENS) + 1)
            tok = _wordpiece_tokenizer(_train_wordpiece_vocab(texts, vocab_size))
            ids = {"pad": _PAD, "cls": _CLS, "sep": _SEP, "mask": _MASK}
            unk = _UNK
            special = set(range(len(SPECIAL_TOKENS)))
            encoded = [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]
            vocab = tok.get_vocab_size()

        n_eval = int(round(len(encoded) * eval_fraction)) if len(encoded) >= 2 else 0
        if eval_fraction > 0 and len(encoded) >= 2:
            n_eval = min(max(1, n_eval), len(encoded) - 1)
        special_f = frozenset(special) | {unk}
        train_docs, eval_docs = encoded[:len(encoded) - n_eval], encoded[len(encoded) - n_eval:]
        train = _pack_documents(train_docs, seq_len, ids["cls"], ids["sep"], special_f)
        evals = _pack_documents(eval_docs, seq_len, ids["cls"], ids["sep"], special_f)
        if not train:
            raise ValueError(f"TextCorpus {source}: no document has a non-special token after "
                             f"tokenisation; check the file's text and the tokenizer")
        logger.info("TextCorpus %s: %d documents -> %d train / %d eval sequences (seq_len=%d, vocab=%d)",
                    source, len(encoded), len(train), len(evals), seq_len, vocab)
        return cls(train, evals, seq_len=seq_len, vocab_size=vocab, pad_id=ids["pad"], unk_id=unk,
                   cls_id=ids["cls"], sep_id=ids["sep"], mask_id=ids["mask"], special_ids=special_f,
                   tokenizer=tok, source=source)

    # -- corpus protocol -----------------------------------------------------------------------

    def num_sequences(self, split: str = "train") -> int:
        return len(self._sequences[_check_split(split)])

    def get_sequence(self, index: int, split: str = "train") -> list[int]:
        seqs = self._sequences[_check_split(split)]
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
            return
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(
            tokenizer_object=self.tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]",
        ).save_pretrained(os.fspath(directory))

    def __repr__(self) -> str:
        return (f"TextCorpus({self.source!r}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
                f"train={self.num_sequences('train')}, eval={self.num_sequences('eval')})")


def _load_hf_tokenizer(tokenizer_dir: str | os.PathLike):
    directory = os.fspath(tokenizer_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"tokenizer_dir {directory!r} does not exist or is not a directory; pass a "
                         f"local HF tokenizer directory (tokenizer.json / vocab files)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError, ...)
        raise ValueError(f"could not load a tokenizer from tokenizer_dir {directory!r} "
                         f"({type(e).__name__}: {e}); it must hold a HF tokenizer "
                         f"saved with save_pretrained") from None


# ----------------------------------------------------------------------------------------------
# masked-LM batches
# ----------------------------------------------------------------------------------------------


class MLMBatcher:
    """Masked-LM batches that are a pure function of the step.

    ``batch_at(step)`` takes rows ``step*B .. step*B+B-1`` of the split's sequence stream (a
    finite corpus is visited epoch by epoch, each epoch in a permutation seeded by
    ``(seed, split, epoch)``; an unbounded corpus is read in order), pads them to ``seq_len`` and
    applies BERT masking: each non-special real token is selected with ``mlm_probability``; of the
    selected, 80% become ``mask_id``, 10% a random non-special token, 10% stay. Every row with a
    maskable token gets at least one selection (the position with the smallest draw is forced when
    the row drew none), so every batch -- and every data-parallel shard -- has labels. All random
    draws are made for the whole global batch from one generator seeded by
    ``(seed, split, step)`` and then sliced, so shards concatenate to exactly the global batch.
    """

    def __init__(
        self,
        corpus: Any,
        global_batch_size: int,
        mlm_probability: float = 0.15,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        for attr in ("vocab_size", "seq_len", "pad_id", "mask_id", "special_ids", "num_sequences", "get_sequence"):
            if not hasattr(corpus, attr):
                raise ValueError(f"MLMBatcher corpus {type(corpus).__name__} has no attribute {attr!r}; "
                                 f"use SyntheticCorpus or TextCorpus")
        _check_int("MLMBatcher global_batch_size", global_batch_size, 1)
        _check_int("MLMBatcher seed", seed, 0)
        if not isinstance(mlm_probability, (int, float)) or not 0.0 < mlm_probability <= 1.0:
            raise ValueError(f"MLMBatcher mlm_probability must be in (0, 1], got {mlm_probability!r}")
        self.corpus = corpus
        self.global_batch_size = global_batch_size
        self.mlm_probability = float(mlm_probability)
        self.seed = seed
        self.split = _check_split(split)
        self.seq_len = corpus.seq_len
        self.num_sequences = corpus.num_sequences(split)
        if self.num_sequences is not None and self.num_sequences < 1:
            raise ValueError(f"MLMBatcher: the corpus has no {split!r} sequences; for TextCorpus add "
                             f"documents or raise eval_fraction")
        if self.num_sequences is not None and self.num_sequences < global_batch_size:
            logger.warning("MLMBatcher: %d %s sequences < global_batch_size=%d; sequences repeat "
                           "within a batch", self.num_sequences, split, global_batch_size)
        self._special = torch.tensor(sorted(corpus.special_ids), dtype=torch.long)
        pool = [i for i in range(corpus.vocab_size) if i not in corpus.special_ids]
        if not pool:
            raise ValueError("MLMBatcher: the corpus vocabulary has no non-special token to sample")
        self._random_pool = torch.tensor(pool, dtype=torch.long)
        self._order = (_EpochPermutation(self.num_sequences, seed, "mlm-order", split)
                       if self.num_sequences is not None else None)

    @property
    def steps_per_epoch(self) -> int | None:
        """Full batches per pass over the split (None for an unbounded corpus)."""
        if self.num_sequences is None:
            return None
        return max(1, self.num_sequences // self.global_batch_size)

    def sequence_index(self, step: int, row: int) -> int:
        """Index (within the split) of the sequence in global row ``row`` of ``step``."""
        position = step * self.global_batch_size + row
        return position if self._order is None else self._order(position)

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` (1 real / 0 pad) and ``labels`` (-100 where not
        predicted), LongTensors ``[rows, seq_len]``; rows = the whole global batch, or the
        contiguous slice of data-parallel shard ``(dp_rank, dp_size)``."""
        _check_int("step", step, 0)
        lo, hi = _shard_bounds(self.global_batch_size, shard)
        B, S = self.global_batch_size, self.seq_len

        ids = torch.full((hi - lo, S), self.corpus.pad_id, dtype=torch.long)
        attention = torch.zeros((hi - lo, S), dtype=torch.long)
        for r in range(lo, hi):
            seq = self.corpus.get_sequence(self.sequence_index(step, r), self.split)
            if len(seq) > S:
                raise ValueError(f"corpus returned a sequence of {len(seq)} tokens > seq_len={S}")
            ids[r - lo, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[r - lo, :len(seq)] = 1

        gen = _generator(self.seed, "mlm-mask", self.split, step)
        select_draw = torch.rand(B, S, generator=gen)[lo:hi]
        kind_draw = torch.rand(B, S, generator=gen)[lo:hi]
        random_tokens = self._random_pool[
            torch.randint(len(self._random_pool), (B, S), generator=gen)[lo:hi]]

        maskable = attention.bool() & ~torch.isin(ids, self._special)
        selected = maskable & (select_draw < self.mlm_probability)
        need = maskable.any(dim=1) & ~selected.any(dim=1)
        if need.any():
            forced = torch.where(maskable, select_draw, torch.full_like(select_draw, 2.0)).argmin(dim=1)
            rows = need.nonzero(as_tuple=True)[0]
            selected[rows, forced[rows]] = True

        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
        input_ids = ids.clone()
        to_mask = selected & (kind_draw < 0.8)
        to_random = selected & (kind_draw >= 0.8) & (kind_draw < 0.9)
        input_ids[to_mask] = self.corpus.mask_id
        input_ids[to_random] = random_tokens[to_random]
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    def __repr__(self) -> str:
        return (f"MLMBatcher({self.corpus!r}, global_batch_size={self.global_batch_size}, "
                f"mlm_probability={self.mlm_probability}, seed={self.seed}, split={self.split!r})")


# ----------------------------------------------------------------------------------------------
# instruction data (LLaMA fine-tuning)
# ----------------------------------------------------------------------------------------------

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_prompt(instruction: str, input: str = "") -> str:  # noqa: A002 (Alpaca's field name)
    """The Alpaca prompt (everything before the response)."""
    if input:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _validate_example(obj: Any, where: str) -> dict[str, str]:
    hint = "each example needs string fields 'instruction' and 'output' (and optionally 'input')"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}; {hint}")
    for key in ("instruction", "output"):
        if key not in obj:
            raise ValueError(f"{where}: missing field {key!r}; {hint}")
        if not isinstance(obj[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
    if not obj["instruction"].strip():
        raise ValueError(f"{where}: field 'instruction' is empty; {hint}")
    inp = obj.get("input")
    if inp is None:
        inp = ""
    if not isinstance(inp, str):
        raise ValueError(f"{where}: field 'input' must be a string, got {type(inp).__name__}")
    return {"instruction": obj["instruction"], "input": inp, "output": obj["output"]}


def load_instruction_data(path: str | os.PathLike) -> list[dict[str, str]]:
    """Alpaca-style examples from a ``.json`` list or a ``.jsonl`` file, as dicts with keys
    ``instruction``, ``input`` ('' when absent) and ``output``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"instruction data file not found: {path!r}; pass an Alpaca-style .json "
                         f"(list of objects) or .jsonl file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".jsonl"):
        raise ValueError(f"instruction data file {path!r} has unsupported extension {ext!r}; use "
                         f".json (a list of objects) or .jsonl (one object per line)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"instruction data file {path!r} is not valid UTF-8 ({e}); re-encode it") from None
    examples: list[dict[str, str]] = []
    if ext == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno} ({e.msg}); a .json file must "
                             f"hold a list of objects (use .jsonl for one object per line)") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: top-level JSON must be a list of examples, got "
                             f"{type(data).__name__}")
        examples = [_validate_example(obj, f"{path}: example {i}") for i, obj in enumerate(data)]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg}); each .jsonl line must be "
                                 f"one example object") from None
            examples.append(_validate_example(obj, f"{path}:{lineno}"))
    if not examples:
        raise ValueError(f"instruction data file {path!r} contains no examples; add at least one")
    logger.info("loaded %d instruction examples from %s", len(examples), path)
    return examples


class ByteTokenizer:
    """Offline byte-level tokenizer: ids 0..255 are UTF-8 bytes, then BOS=256, EOS=257, PAD=258."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """The :class:`ByteTokenizer` interface over a local ``transformers`` tokenizer directory.
    ``pad_id`` falls back to ``eos_id`` (LLaMA tokenizers have no pad); ``bos_id`` may be None."""

    def __init__(self, tokenizer: Any, name: str = "<hf>") -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no eos token; instruction tuning needs one to "
                             f"end each response")
        self.tokenizer = tokenizer
        self.name = name
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_dir(cls, tokenizer_dir: str | os.PathLike) -> "HFTokenizer":
        return cls(_load_hf_tokenizer(tokenizer_dir), name=os.fspath(tokenizer_dir))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(tokenizer_dir: str | os.PathLike | None = None) -> ByteTokenizer | HFTokenizer:
    """A local HF tokenizer when ``tokenizer_dir`` is given, else the offline :class:`ByteTokenizer`."""
    return ByteTokenizer() if tokenizer_dir is None else HFTokenizer.from_dir(tokenizer_dir)


class InstructionBatcher:
    """Causal-LM batches for instruction tuning, a pure function of the step.

    Each example becomes ``[BOS] prompt response [EOS]`` (BOS only when the tokenizer has one),
    the prompt being :func:`format_prompt` of instruction and input. ``labels`` equal
    ``input_ids`` on response and EOS positions and are -100 elsewhere (BOS, prompt, padding);
    they are *not* shifted -- the model/loss predicts ``labels[:, t+1]`` from position ``t``, as in
    HF causal LMs. Examples longer than ``seq_len`` keep their prompt and lose the end of the
    response (the EOS too); examples whose prompt alone fills ``seq_len`` are dropped with a warning.

    Rows: one example per row, or with ``pack=True`` several whole examples per row (next-fit, in
    an order seeded by ``seed``; packed once, so a row's members are fixed across epochs). Each
    epoch visits all rows in a permutation seeded by ``(seed, epoch)``; ``batch_at(step)`` takes
    rows ``step*B .. step*B+B-1`` of that stream and right-pads them to the longest row of the
    *global* batch (so all shards have the same width). Packed rows carry no cross-example
    attention mask: the causal attention sees earlier examples in the row.
    """

    def __init__(
        self,
        examples: Sequence[dict[str, Any]],
        tokenizer: Any,
        seq_len: int,
        global_batch_size: int,
        seed: int = 0,
        pack: bool = False,
    ) -> None:
        _check_int("InstructionBatcher seq_len", seq_len, 2)
        _check_int("InstructionBatcher global_batch_size", global_batch_size, 1)
        _check_int("InstructionBatcher seed", seed, 0)
        for attr in ("encode", "eos_id", "pad_id"):
            if not hasattr(tokenizer, attr):
                raise ValueError(f"InstructionBatcher tokenizer {type(tokenizer).__name__} has no "
                                 f"{attr!r}; use ByteTokenizer or HFTokenizer (load_tokenizer)")
        if not examples:
            raise ValueError("InstructionBatcher: examples is empty; load some with load_instruction_data")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.pack = bool(pack)

        bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
        self._tokens: list[list[int]] = []
        self._prompt_len: list[int] = []
        dropped = truncated = 0
        for i, raw in enumerate(examples):
            ex = _validate_example(raw, f"InstructionBatcher example {i}")
            prompt = bos + list(tokenizer.encode(format_prompt(ex["instruction"], ex["input"])))
            response = list(tokenizer.encode(ex["output"])) + [tokenizer.eos_id]
            if len(prompt) >= seq_len:
                dropped += 1
                continue
            if len(prompt) + len(response) > seq_len:
                truncated += 1
            self._tokens.append((prompt + response)[:seq_len])
            self._prompt_len.append(len(prompt))
        if dropped:
            logger.warning("InstructionBatcher: dropped %d of %d examples whose prompt fills "
                           "seq_len=%d", dropped, len(examples), seq_len)
        if truncated:
            logger.warning("InstructionBatcher: truncated the response of %d examples to seq_len=%d",
                           truncated, seq_len)
        if not self._tokens:
            raise ValueError(f"InstructionBatcher: every prompt is at least seq_len={seq_len} tokens "
                             f"long, so no response fits; raise seq_len")
        self.num_examples = len(self._tokens)

        if self.pack:
            order = torch.randperm(self.num_examples, generator=_generator(seed, "instr-pack")).tolist()
            self._rows: list[list[int]] = []
            current: list[int] = []
            used = 0
            for i in order:
                n = len(self._tokens[i])
                if current and used + n > seq_len:
                    self._rows.append(current)
                    current, used = [], 0
                current.append(i)
                used += n
            self._rows.append(current)
        else:
            self._rows = [[i] for i in range(self.num_examples)]
        self._row_len = [sum(len(self._tokens[i]) for i in row) for row in self._rows]
        self.num_rows = len(self._rows)
        self._order = _EpochPermutation(self.num_rows, seed, "instr-order")
        logger.info("InstructionBatcher: %d examples -> %d rows (pack=%s, seq_len=%d)",
                    self.num_examples, self.num_rows, self.pack, seq_len)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_rows // self.global_batch_size)

    def row_examples(self, step: int, row: int) -> list[int]:
        """Indices (into the kept examples) packed in global row ``row`` of ``step``."""
        return list(self._rows[self._order(step * self.global_batch_size + row)])

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``labels`` LongTensors ``[rows, width]``, width =
        longest row of the global batch (<= seq_len)."""
        _check_int("step", step, 0)
        lo, hi = _shard_bounds(self.global_batch_size, shard)
        rows = [self._order(step * self.global_batch_size + r) for r in range(self.global_batch_size)]
        width = max(self._row_len[r] for r in rows)
        input_ids = torch.full((hi - lo, width), self.tokenizer.pad_id, dtype=torch.long)
        attention = torch.zeros((hi - lo, width), dtype=torch.long)
        labels = torch.full((hi - lo, width), IGNORE_INDEX, dtype=torch.long)
        for out, r in enumerate(rows[lo:hi]):
            pos = 0
            for i in self._rows[r]:
                toks, n_prompt = self._tokens[i], self._prompt_len[i]
                t = torch.tensor(toks, dtype=torch.long)
                input_ids[out, pos:pos + len(toks)] = t
                attention[out, pos:pos + len(toks)] = 1
                labels[out, pos + n_prompt:pos + len(toks)] = t[n_prompt:]
                pos += len(toks)
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    def __repr__(self) -> str:
        return (f"InstructionBatcher({self.num_examples} examples, seq_len={self.seq_len}, "
                f"global_batch_size={self.global_batch_size}, seed={self.seed}, pack={self.pack})")


# ----------------------------------------------------------------------------------------------
# labelled data (sequence classification)
# ----------------------------------------------------------------------------------------------


def load_labelled_data(path: str | os.PathLike) -> list[tuple[str, int]]:
    """``(text, label)`` pairs from a JSONL file of ``{"text": str, "label": int >= 0}`` objects."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"labelled data file {path!r} does not exist; give a .jsonl file of "
                         '{"text": ..., "label": ...} lines')
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f'{path}:{n}: each line must be an object with a string "text" field')
            label = obj.get("label")
            if not isinstance(label, int) or isinstance(label, bool) or label < 0:
                raise ValueError(f'{path}:{n}: "label" must be a non-negative integer class id, got {label!r}')
            pairs.append((obj["text"], label))
    if not pairs:
        raise ValueError(f"labelled data file {path!r} holds no examples")
    return pairs


class ClassificationBatcher:
    """Sequence-classification batches, a pure function of the step.

    Each example is ``[CLS] tokens [SEP]`` (tokens cut to fit ``seq_len``), right-padded to
    ``seq_len``; ``labels`` is one class id per row. Each epoch visits the examples in a
    permutation seeded by ``(seed, epoch)``; ``batch_at(step, shard)`` takes rows
    ``step*B .. step*B+B-1`` of that stream (a data-parallel shard: its contiguous slice).
    ``encode(text) -> list[int]`` tokenizes without special tokens (``TextCorpus.encode``).
    """

    def __init__(self, examples: Sequence[tuple[str, int]], encode: Callable[[str], list[int]], seq_len: int,
                 global_batch_size: int, *, cls_id: int, sep_id: int, pad_id: int, seed: int = 0) -> None:
        _check_int("ClassificationBatcher seq_len", seq_len, 3)
        _check_int("ClassificationBatcher global_batch_size", global_batch_size, 1)
        if not examples:
            raise ValueError("ClassificationBatcher: no examples")
        self.seq_len, self.global_batch_size, self.pad_id = seq_len, global_batch_size, pad_id
        self._rows = [[cls_id] + list(encode(text))[:seq_len - 2] + [sep_id] for text, _ in examples]
        self._labels = [label for _, label in examples]
        self.num_examples = len(self._rows)
        self.num_labels = max(self._labels) + 1
        self._order = _EpochPermutation(self.num_examples, seed, "classify-order")

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        _check_int("step", step, 0)
        lo, hi = _shard_bounds(self.global_batch_size, shard)
        ids = torch.full((hi - lo, self.seq_len), self.pad_id, dtype=torch.long)
        attention = torch.zeros((hi - lo, self.seq_len), dtype=torch.long)
        labels = torch.empty(hi - lo, dtype=torch.long)
        for out, r in enumerate(range(lo, hi)):
            i = self._order(step * self.global_batch_size + r)
            row = self._rows[i]
            ids[out, :len(row)] = torch.tensor(row, dtype=torch.long)
            attention[out, :len(row)] = 1
            labels[out] = self._labels[i]
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}
