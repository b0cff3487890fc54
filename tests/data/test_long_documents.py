"""A long document reaches the tokenizers library in pieces cut at spaces (a 50 MB one-line corpus took 8.3 GB
whole): the pieces' words are the whole text's under the BERT normalizer and pre-tokenizer, so the trained
WordPiece encodes the pieces to exactly the whole text's ids; a corpus file is read line by line into the
documents a whole-file read gives."""

from __future__ import annotations

import random

from galaxy.data.corpus import read_documents
from galaxy.data.tokenizer import encode_wordpiece, space_pieces, train_wordpiece


def long_text(words: int, seed: int = 0) -> str:
    """Words with punctuation, accents, CJK, Greek final sigma, tabs and runs of spaces between them."""
    rng = random.Random(seed)
    vocab = ["alpha", "Béta", "γάμμα", "ΟΔΟΣ", "中文", "don't", "x1,y2", "naïve", "ΣΟΦΟΣ", "end."]
    seps = [" ", " ", " ", "  ", "\t", " - ", "; "]
    return "".join(rng.choice(vocab) + rng.choice(seps) for _ in range(words)).strip()


def words(tok, text: str) -> list[str]:
    normalized = tok.normalizer.normalize_str(text)
    return [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(normalized)]


def test_pieces_cut_at_spaces_keep_the_words_and_the_ids():
    text = long_text(3000)
    tok = train_wordpiece([long_text(500, seed=s) for s in range(1, 4)], 120)
    pieces = list(space_pieces(text, 200))
    assert len(pieces) > 50 and "".join(pieces) == text
    assert all(p.startswith(" ") for p in pieces[1:])
    assert [w for p in pieces for w in words(tok, p)] == words(tok, text)
    whole = tok.encode(text, add_special_tokens=False).ids
    short = "γάμμα ΟΔΟΣ"
    assert encode_wordpiece(tok, [text, short, text], piece_chars=200, batch_chars=1000) == \
        [whole, tok.encode(short, add_special_tokens=False).ids, whole]


def test_a_text_without_spaces_stays_whole():
    assert list(space_pieces("x" * 1000, 10)) == ["x" * 1000]
    assert list(space_pieces("short", 10)) == ["short"]


def test_documents_read_line_by_line_are_the_whole_files(tmp_path):
    text = "first doc\r\nsecond\u2028third\n\n  \nfourth \x0c fifth\n" + long_text(2000) + "\nlast"
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode("utf-8"))
    with open(path, encoding="utf-8") as f:
        expected = [line.strip() for line in f.read().splitlines() if line.strip()]
    assert read_documents(str(path)) == expected
