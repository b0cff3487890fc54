"""Tokenizers: a WordPiece trained with the ``tokenizers`` library, local HF tokenizer directories,
and the offline byte-level fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from galaxy.errors import DataError

logger = logging.getLogger(__name__)

#: Compact special-token layout shared by SyntheticCorpus and the trained WordPiece.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_FILE = "tokenizer.json"
# The tokenizers library keeps per-character buffers of each text it normalizes (offsets, several copies):
# a 50 MB one-line document took 8.3 GB. The trained WordPiece gets texts in pieces of about this many
# characters, and encodes about BATCH_CHARS of them per call.
PIECE_CHARS = 1 << 16
BATCH_CHARS = 1 << 23


def space_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at least ``size`` characters (the last may be shorter), each cut just
    before a space: a BERT normalizer and pre-tokenizer split words there, so the words (and the WordPiece
    tokens) of the pieces are the text's. A stretch without a space stays whole."""
    start = 0
    while len(text) - start > size:
        cut = text.find(" ", start + size)
        if cut < 0:
            break
        yield text[start:cut]
        start = cut
    yield text[start:] if start else text


# ----------------------------------------------------------------------------- trained WordPiece

def train_wordpiece(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """A BERT-style WordPiece (lower-casing Bert normalizer and pre-tokenizer, ``##`` continuations,
    ``SPECIAL_TOKENS`` at ids 0..4) learned by ``tokenizers``' own ``WordPieceTrainer``.

    The trainer breaks count ties in hash-map order, so two processes can learn different (equally
    good) vocabularies from the same texts: a run trains once and hands the result to every rank
    (:func:`shared_wordpiece`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"WordPiece vocab_size must be an int > {len(SPECIAL_TOKENS)}, got {vocab_size!r}")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=list(SPECIAL_TOKENS), continuing_subword_prefix="##",
                                        show_progress=False)
    tok.train_from_iterator((piece for text in texts for piece in space_pieces(text)), trainer)
    return tok


def encode_wordpiece(tok, texts: Sequence[str], piece_chars: int = PIECE_CHARS,
                     batch_chars: int = BATCH_CHARS) -> list[list[int]]:
    """The ids of each text (no special tokens) under a trained WordPiece ``tok``: the texts' ``space_pieces``
    (of ``piece_chars``) encoded about ``batch_chars`` characters at a time, so that no call holds a whole long
    document."""
    ids: list[list[int]] = [[] for _ in texts]
    pieces: list[str] = []
    owners: list[int] = []
    size = 0

    def flush() -> None:
        for owner, encoding in zip(owners, tok.encode_batch(pieces, add_special_tokens=False)):
            ids[owner].extend(encoding.ids)
        pieces.clear()
        owners.clear()

    for i, text in enumerate(texts):
        for piece in space_pieces(text, piece_chars):
            pieces.append(piece)
            owners.append(i)
            size += len(piece)
            if size >= batch_chars:
                flush()
                size = 0
    flush()
    return ids


def check_wordpiece(tok) -> None:
    """A trained WordPiece must hold ``SPECIAL_TOKENS`` at ids 0..4 (the corpora's layout)."""
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise ValueError(f"tokenizer has {name} at id {tok.token_to_id(name)}, not {i}; train it with "
                             "galaxy.data.tokenizer.train_wordpiece or pass a HF tokenizer directory instead")


def wordpiece_fingerprint(texts: Sequence[str], vocab_size: int, min_frequency: int = 2) -> str:
    """What a trained WordPiece depends on: the texts, the settings and the library's version."""
    import tokenizers

    h = hashlib.sha256(f"wordpiece/{tokenizers.__version__}/{vocab_size}/{min_frequency}".encode())
    for text in texts:
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def default_tokenizer_cache() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "galaxy", "tokenizers")


def shared_wordpiece(texts: Sequence[str], vocab_size: int, share: Callable[[Callable[[], str]], str],
                     cache_dir: Optional[str] = None, min_frequency: int = 2):
    """The run's WordPiece, identical on every rank and across runs on the same texts and settings.

    ``share(make)`` calls ``make()`` on one rank (global rank 0) and returns its string on every rank.
    That rank reuses ``<cache_dir>/<fingerprint>/tokenizer.json`` when an earlier run trained on the
    same texts and settings, else trains once and writes it there (atomically); every rank then
    builds the tokenizer from the same JSON text."""
    from tokenizers import Tokenizer

    def make() -> str:
        directory = os.path.join(cache_dir or default_tokenizer_cache(),
                                 wordpiece_fingerprint(texts, vocab_size, min_frequency))
        path = os.path.join(directory, TOKENIZER_FILE)
        if os.path.isfile(path):
            logger.info("WordPiece: reusing %s", path)
            with open(path, encoding="utf-8") as f:
                return f.read()
        logger.info("WordPiece: training a vocabulary of %d on %d texts (%.1f MB)", vocab_size, len(texts),
                    sum(map(len, texts)) / 2**20)
        text = train_wordpiece(texts, vocab_size, min_frequency).to_str()
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)
        logger.info("WordPiece: trained on %d texts (vocab %d), saved to %s", len(texts), vocab_size, path)
        return text

    tok = Tokenizer.from_str(share(make))
    check_wordpiece(tok)
    return tok


def save_wordpiece(tok, directory: str | os.PathLike) -> None:
    """Write a trained WordPiece as a HF tokenizer directory (``tokenizer.json`` plus, where
    ``transformers`` imports, its config files), loadable with ``--tokenizer``."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        tok.save(os.path.join(directory, TOKENIZER_FILE))
        return
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(directory)


# ----------------------------------------------------------------------------- HF directories and bytes

def load_hf_tokenizer(tokenizer_dir: str | os.PathLike):
    directory = os.fspath(tokenizer_dir)
    if not os.path.isdir(directory):
        raise DataError(f"tokenizer_dir {directory!r} does not exist or is not a directory; pass a "
                        f"local HF tokenizer directory (tokenizer.json / vocab files)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError, ...)
        raise DataError(f"could not load a tokenizer from tokenizer_dir {directory!r} "
                        f"({type(e).__name__}: {e}); it must hold a HF tokenizer "
                        f"saved with save_pretrained") from None


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
            raise DataError(f"tokenizer {name!r} has no eos token; instruction tuning needs one to "
                            f"end each response")
        self.tokenizer = tokenizer
        self.name = name
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_dir(cls, tokenizer_dir: str | os.PathLike) -> "HFTokenizer":
        return cls(load_hf_tokenizer(tokenizer_dir), name=os.fspath(tokenizer_dir))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(tokenizer_dir: str | os.PathLike | None = None) -> ByteTokenizer | HFTokenizer:
    """A local HF tokenizer when ``tokenizer_dir`` is given, else the offline :class:`ByteTokenizer`."""
    return ByteTokenizer() if tokenizer_dir is None else HFTokenizer.from_dir(tokenizer_dir)
