"""Tests for galaxy.data: deterministic offline MLM and instruction-tuning data, the trained tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from galaxy.data.corpus import SyntheticCorpus, TextCorpus
from galaxy.data.instruction import InstructionBatcher, format_prompt, load_instruction_data
from galaxy.data.mlm import MLMBatcher
from galaxy.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests import REPO  # noqa: E402

REPO = Path(REPO)
SAMPLE = REPO / "data" / "alpaca_sample.jsonl"

WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps near the warm "
         "fire and birds sing songs about rivers mountains forests cities trains ships").split()


def _docs(n: int = 60, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        k = int(torch.randint(4, 30, (1,), generator=g))
        idx = torch.randint(len(WORDS), (k,), generator=g).tolist()
        docs.append(f"document{i} " + " ".join(WORDS[j] for j in idx) + ".")
    return docs


def _write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return path


def _original_ids(batcher: MLMBatcher, step: int) -> torch.Tensor:
    """The unmasked, padded token ids of a global batch, rebuilt from the corpus."""
    out = torch.full((batcher.global_batch_size, batcher.seq_len), batcher.corpus.pad_id)
    for r in range(batcher.global_batch_size):
        seq = batcher.corpus.get_sequence(batcher.sequence_index(step, r), batcher.split)
        out[r, :len(seq)] = torch.tensor(seq)
    return out


def _digest(batch: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(batch[k].numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A BERT-style HF tokenizer built offline, with a special-id layout unlike the compact one."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]  # deliberately not the compact order
    tok.train_from_iterator(_docs(80, seed=3), trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", unk_token="[UNK]",
                                   eos_token="[SEP]")
    d = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(str(d))
    return d


# ------------------------------------------------------------------------------ synthetic corpus


def test_synthetic_layout_and_structure():
    c = SyntheticCorpus(vocab_size=100, seq_len=32, seed=1)
    assert (c.pad_id, c.unk_id, c.cls_id, c.sep_id, c.mask_id) == (0, 1, 2, 3, 4)
    lengths = set()
    for i in range(50):
        s = c.get_sequence(i)
        assert s[0] == c.cls_id and s[-1] == c.sep_id
        assert 16 <= len(s) <= 32
        assert all(5 <= t < 100 for t in s[1:-1])
        lengths.add(len(s))
    assert len(lengths) > 5 and max(lengths) == 32  # variable real length -> padding
    assert c.get_sequence(7) == SyntheticCorpus(100, 32, seed=1).get_sequence(7)
    assert c.get_sequence(7) != SyntheticCorpus(100, 32, seed=2).get_sequence(7)
    # reserved specials are never emitted
    c8 = SyntheticCorpus(vocab_size=64, seq_len=16, seed=0, num_special=8)
    assert all(t >= 8 for i in range(20) for t in c8.get_sequence(i)[1:-1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(vocab_size=10, seq_len=16), "vocab_size"),
    (dict(vocab_size=100, seq_len=3), "seq_len"),
    (dict(vocab_size=100, seq_len=16, num_special=4), "num_special"),
    (dict(vocab_size=100, seq_len=16, seed=-1), "seed"),
])
def test_synthetic_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticCorpus(**kwargs)


# ------------------------------------------------------------------------------ MLM batches


def test_mlm_batch_shapes_and_determinism():
    c = SyntheticCorpus(200, 32, seed=0)
    b1, b2 = MLMBatcher(c, 8, seed=5), MLMBatcher(SyntheticCorpus(200, 32, seed=0), 8, seed=5)
    x = b1.batch_at(3)
    assert set(x) == {"input_ids", "attention_mask", "labels"}
    for v in x.values():
        assert v.dtype == torch.long and v.shape == (8, 32)
    assert (x["attention_mask"] == 0).any()  # padding present
    assert _digest(x) == _digest(b2.batch_at(3)) == _digest(b1.batch_at(3))
    assert _digest(x) != _digest(b1.batch_at(4))
    assert _digest(x) != _digest(MLMBatcher(c, 8, seed=6).batch_at(3))
    # resume: asking for step 3 first or after other steps gives the same batch
    fresh = MLMBatcher(c, 8, seed=5)
    assert _digest(fresh.batch_at(3)) == _digest(x)


def test_mlm_same_batch_in_other_processes(tmp_path):
    """Batches are identical across processes, whatever PYTHONHASHSEED is."""
    code = textwrap.dedent("""
        import hashlib
        from galaxy.data.corpus import SyntheticCorpus
        from galaxy.data.mlm import MLMBatcher
        b = MLMBatcher(SyntheticCorpus(300, 24, seed=4), 6, seed=9).batch_at(11)
        h = hashlib.sha256()
        for k in sorted(b):
            h.update(k.encode()); h.update(b[k].numpy().tobytes())
        print(h.hexdigest())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO)))
             for hash_seed in ("1", "2")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.split())
    here = MLMBatcher(SyntheticCorpus(300, 24, seed=4), 6, seed=9).batch_at(11)
    assert outs[0] == outs[1] == [_digest(here)]


def _vocab_bytes_in_a_new_process(txt: Path, cache: Path, hash_seed: str) -> str:
    code = textwrap.dedent(f"""
        import hashlib
        from galaxy.data.corpus import read_documents
        from galaxy.data.tokenizer import shared_wordpiece
        tok = shared_wordpiece(read_documents({str(txt)!r}), 120, lambda make: make(), cache_dir={str(cache)!r})
        print(hashlib.sha256(tok.to_str().encode()).hexdigest())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_run_wordpiece_is_byte_identical_across_runs(tmp_path):
    """tokenizers' own WordPieceTrainer breaks ties in hash-map order, so the run's vocabulary is trained
    once and reused by later runs on the same texts and settings: two runs (processes with different
    hash seeds) get byte-identical tokenizer files."""
    txt = _write_txt(tmp_path / "c.txt", _docs(40))
    first = _vocab_bytes_in_a_new_process(txt, tmp_path / "cache", "1")
    assert _vocab_bytes_in_a_new_process(txt, tmp_path / "cache", "2") == first
    saved = list((tmp_path / "cache").glob("*/tokenizer.json"))
    assert len(saved) == 1 and hashlib.sha256(saved[0].read_bytes()).hexdigest() == first
    # another vocabulary size is another tokenizer, trained anew beside the first
    from galaxy.data.corpus import read_documents
    from galaxy.data.tokenizer import shared_wordpiece

    other = shared_wordpiece(read_documents(str(txt)), 90, lambda make: make(), cache_dir=str(tmp_path / "cache"))
    assert other.get_vocab_size() <= 90 and len(list((tmp_path / "cache").glob("*/tokenizer.json"))) == 2


def wordpiece_on_rank(ctx, txt: str, cache: str) -> str:
    from galaxy.data.corpus import read_documents
    from galaxy.data.tokenizer import shared_wordpiece

    tok = shared_wordpiece(read_documents(txt), 120, ctx.from_rank0, cache_dir=cache)
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def failing_on_rank0(ctx) -> str:
    def make() -> str:
        raise ValueError("the data file is unreadable")
    try:
        return ctx.from_rank0(make)
    except ValueError as e:
        return str(e)


def test_run_wordpiece_is_identical_on_every_rank(dist_pool, tmp_path):
    """Rank 0 trains once; every rank builds the tokenizer from the same JSON (bytes compared)."""
    from tests.dist_pool import MAX_WORLD

    txt = _write_txt(tmp_path / "c.txt", _docs(40))
    digests = dist_pool.run(wordpiece_on_rank, MAX_WORLD, str(txt), str(tmp_path / "cache"))
    assert len(set(digests)) == 1
    saved = list((tmp_path / "cache").glob("*/tokenizer.json"))
    assert len(saved) == 1 and hashlib.sha256(saved[0].read_bytes()).hexdigest() == digests[0]
    # a failure on rank 0 reaches every rank as one line, instead of leaving the others waiting
    assert dist_pool.run(failing_on_rank0, MAX_WORLD) == ["rank 0: the data file is unreadable"] * MAX_WORLD


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
def test_mlm_shards_concatenate_to_global_batch(dp_size):
    b = MLMBatcher(SyntheticCorpus(150, 20, seed=0), 8, seed=1)
    full = b.batch_at(7)
    shards = [b.batch_at(7, shard=(r, dp_size)) for r in range(dp_size)]
    for k in full:
        assert torch.equal(torch.cat([s[k] for s in shards]), full[k])


def test_mlm_shard_errors():
    b = MLMBatcher(SyntheticCorpus(150, 20, seed=0), 6, seed=1)
    with pytest.raises(ValueError, match="not divisible by dp_size=4"):
        b.batch_at(0, shard=(0, 4))
    with pytest.raises(ValueError, match="dp_rank=2 must be < dp_size=2"):
        b.batch_at(0, shard=(2, 2))
    with pytest.raises(ValueError, match="step"):
        b.batch_at(-1)


def test_mlm_masking_statistics_and_labels():
    c = SyntheticCorpus(1000, 64, seed=0)
    b = MLMBatcher(c, 512, mlm_probability=0.15, seed=0)
    x = b.batch_at(2)
    orig = _original_ids(b, 2)
    labelled = x["labels"] != -100
    real = x["attention_mask"] == 1
    special = torch.isin(orig, torch.tensor(sorted(c.special_ids)))
    maskable = real & ~special

    # labels only where predicted, equal to the original tokens; never on specials or padding
    assert torch.equal(x["labels"][labelled], orig[labelled])
    assert not (labelled & ~maskable).any()
    # unlabelled positions are untouched
    assert torch.equal(x["input_ids"][~labelled], orig[~labelled])
    assert torch.equal(real, orig != c.pad_id)

    rate = labelled.sum().item() / maskable.sum().item()
    assert abs(rate - 0.15) < 0.01, rate
    n = labelled.sum().item()
    as_mask = (x["input_ids"] == c.mask_id) & labelled
    changed = labelled & (x["input_ids"] != orig) & ~as_mask
    kept = labelled & (x["input_ids"] == orig)
    assert abs(as_mask.sum().item() / n - 0.8) < 0.02
    assert abs(changed.sum().item() / n - 0.1) < 0.015
    assert abs(kept.sum().item() / n - 0.1) < 0.015
    # random replacements are never special tokens
    assert not torch.isin(x["input_ids"][changed], torch.tensor(sorted(c.special_ids))).any()
    assert (x["input_ids"][~real] == c.pad_id).all()


def test_mlm_at_least_one_masked_token_per_row():
    b = MLMBatcher(SyntheticCorpus(100, 16, seed=0), 16, mlm_probability=1e-6, seed=0)
    for step in range(3):
        x = b.batch_at(step)
        assert ((x["labels"] != -100).sum(dim=1) >= 1).all()
        for r in range(2):
            assert (b.batch_at(step, shard=(r, 2))["labels"] != -100).any()


def test_mlm_eval_split_disjoint():
    c = SyntheticCorpus(300, 32, seed=0)
    tr, ev = MLMBatcher(c, 16, seed=0), MLMBatcher(c, 16, seed=0, split="eval")
    train_seqs = {tuple(c.get_sequence(tr.sequence_index(s, r), "train")) for s in range(20) for r in range(16)}
    eval_seqs = {tuple(c.get_sequence(ev.sequence_index(s, r), "eval")) for s in range(20) for r in range(16)}
    assert len(train_seqs) == 320 and len(eval_seqs) == 320
    assert not train_seqs & eval_seqs
    assert _digest(tr.batch_at(0)) != _digest(ev.batch_at(0))
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        MLMBatcher(c, 4, split="test")


def test_mlm_bad_args():
    c = SyntheticCorpus(100, 16)
    with pytest.raises(ValueError, match="mlm_probability"):
        MLMBatcher(c, 4, mlm_probability=0.0)
    with pytest.raises(ValueError, match="global_batch_size"):
        MLMBatcher(c, 0)
    with pytest.raises(ValueError, match="has no attribute"):
        MLMBatcher(object(), 4)


# ------------------------------------------------------------------------------ text corpus


def test_text_corpus_trained_wordpiece(tmp_path):
    docs = _docs(60)
    c = TextCorpus.from_file(_write_txt(tmp_path / "c.txt", docs), seq_len=48, vocab_size=150)
    assert (c.pad_id, c.unk_id, c.cls_id, c.sep_id, c.mask_id) == (0, 1, 2, 3, 4)
    assert 40 < c.vocab_size <= 150
    assert c.num_sequences("train") > 0 and c.num_sequences("eval") > 0
    lengths = set()
    for split in ("train", "eval"):
        for i in range(c.num_sequences(split)):
            s = c.get_sequence(i, split)
            assert s[0] == c.cls_id and s[-1] == c.sep_id and len(s) <= 48
            assert all(0 <= t < c.vocab_size for t in s)
            lengths.add(len(s))
    assert min(lengths) < 48  # some padding
    # the WordPiece encodes the corpus text without [UNK] and decodes it back (lower-cased)
    enc = c.tokenizer.encode(docs[0], add_special_tokens=False)
    assert c.unk_id not in enc.ids
    assert c.tokenizer.decode(enc.ids) == docs[0].lower()

    # split by document: eval = packing of the last documents only, nothing shared with train
    n_eval = 6  # round(60 * 0.1)
    tail = [e.ids for e in c.tokenizer.encode_batch(docs[-n_eval:], add_special_tokens=False)]
    eval_tokens = [t for i in range(c.num_sequences("eval")) for t in c.get_sequence(i, "eval")
                   if t not in (c.cls_id, c.sep_id)]
    assert eval_tokens == [t for d in tail for t in d]
    train_seqs = {tuple(c.get_sequence(i, "train")) for i in range(c.num_sequences("train"))}
    assert not train_seqs & {tuple(c.get_sequence(i, "eval")) for i in range(c.num_sequences("eval"))}

    b = MLMBatcher(c, 4, seed=0)
    x = b.batch_at(0)
    orig = _original_ids(b, 0)
    lab = x["labels"] != -100
    assert lab.any() and torch.equal(x["labels"][lab], orig[lab])
    assert not torch.isin(orig[lab], torch.tensor(sorted(c.special_ids))).any()
    MLMBatcher(c, 4, seed=0, split="eval").batch_at(0)


def test_text_corpus_jsonl_and_epoch_coverage(tmp_path):
    docs = _docs(30, seed=1)
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    c = TextCorpus.from_file(path, seq_len=24, vocab_size=100, eval_fraction=0.0)
    assert c.num_sequences("eval") == 0
    with pytest.raises(ValueError, match="no 'eval' sequences"):
        MLMBatcher(c, 2, split="eval")
    n = c.num_sequences("train")
    b = MLMBatcher(c, 1, seed=3)
    seen = [b.sequence_index(s, 0) for s in range(2 * n)]
    assert sorted(seen[:n]) == list(range(n)) and sorted(seen[n:]) == list(range(n))
    assert seen[:n] != seen[n:]  # each epoch reshuffled


def test_text_corpus_long_documents_are_chunked():
    c = TextCorpus.from_texts([" ".join(WORDS * 5)], seq_len=16, vocab_size=200, eval_fraction=0.0)
    assert c.num_sequences("train") > 3
    assert all(len(c.get_sequence(i)) <= 16 for i in range(c.num_sequences("train")))


def test_text_corpus_hf_tokenizer_dir(tmp_path, hf_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir), local_files_only=True)
    docs = _docs(40, seed=3)
    c = TextCorpus.from_file(_write_txt(tmp_path / "c.txt", docs), seq_len=40,
                             tokenizer_dir=hf_tokenizer_dir)
    assert (c.pad_id, c.cls_id, c.sep_id, c.mask_id, c.unk_id) == (
        hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id, hf.unk_token_id)
    assert (c.cls_id, c.mask_id) == (1, 3)  # the directory's layout, not the compact one
    assert c.vocab_size == len(hf)
    all_train = [t for i in range(c.num_sequences("train")) for t in c.get_sequence(i)]
    assert all_train[:len(hf.encode(docs[0], add_special_tokens=False)) + 1] == (
        [hf.cls_token_id] + hf.encode(docs[0], add_special_tokens=False))
    b = MLMBatcher(c, 8, seed=0)
    x = b.batch_at(1)
    orig = _original_ids(b, 1)
    lab = x["labels"] != -100
    assert torch.equal(x["labels"][lab], orig[lab])
    assert not torch.isin(orig[lab], torch.tensor(hf.all_special_ids)).any()
    assert not torch.isin(x["input_ids"][lab & (x["input_ids"] != orig)],
                          torch.tensor([i for i in hf.all_special_ids if i != hf.mask_token_id])).any()


def test_trained_tokenizer_save_and_reload(tmp_path):
    docs = _docs(30, seed=5)
    path = _write_txt(tmp_path / "c.txt", docs)
    c = TextCorpus.from_file(path, seq_len=32, vocab_size=120)
    c.save_tokenizer(tmp_path / "tok")
    c2 = TextCorpus.from_file(path, seq_len=32, tokenizer_dir=tmp_path / "tok")
    assert (c2.pad_id, c2.unk_id, c2.cls_id, c2.sep_id, c2.mask_id) == (0, 1, 2, 3, 4)
    assert c2.vocab_size == c.vocab_size
    for split in ("train", "eval"):
        assert [c.get_sequence(i, split) for i in range(c.num_sequences(split))] == \
               [c2.get_sequence(i, split) for i in range(c2.num_sequences(split))]


def test_text_corpus_errors(tmp_path, hf_tokenizer_dir):
    with pytest.raises(ValueError, match="not found: .*missing.txt"):
        TextCorpus.from_file(tmp_path / "missing.txt", seq_len=16)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    with pytest.raises(ValueError, match="empty.txt.*contains no documents"):
        TextCorpus.from_file(empty, seq_len=16)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: JSON line has no 'text' field"):
        TextCorpus.from_file(bad, seq_len=16)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: invalid JSON"):
        TextCorpus.from_file(broken, seq_len=16)
    csv = tmp_path / "c.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        TextCorpus.from_file(csv, seq_len=16)
    ok = _write_txt(tmp_path / "ok.txt", _docs(5))
    with pytest.raises(ValueError, match="tokenizer_dir .*nope.* does not exist"):
        TextCorpus.from_file(ok, seq_len=16, tokenizer_dir=tmp_path / "nope")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="could not load a tokenizer from tokenizer_dir"):
        TextCorpus.from_file(ok, seq_len=16, tokenizer_dir=tmp_path / "emptydir")
    with pytest.raises(ValueError, match="seq_len"):
        TextCorpus.from_file(ok, seq_len=2)
    with pytest.raises(ValueError, match="eval_fraction"):
        TextCorpus.from_file(ok, seq_len=16, eval_fraction=1.0)


def test_text_corpus_tokenizer_without_mask_token(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_docs(10), trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                            sep_token="</s>").save_pretrained(str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="has no mask token"):
        TextCorpus.from_texts(_docs(5), seq_len=16, tokenizer_dir=tmp_path / "tok")


# ------------------------------------------------------------------------------ instruction data


def test_sample_instruction_file():
    ex = load_instruction_data(SAMPLE)
    assert 35 <= len(ex) <= 60
    assert all(set(e) == {"instruction", "input", "output"} for e in ex)
    assert any(e["input"] for e in ex) and any(not e["input"] for e in ex)
    assert len({e["instruction"] + e["input"] for e in ex}) == len(ex)


def test_load_instruction_json_list_and_errors(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"instruction": "Say hi.", "output": "hi"},
                             {"instruction": "Add.", "input": "1 + 1", "output": "2"},
                             {"instruction": "Echo.", "input": None, "output": "x"}]))
    ex = load_instruction_data(p)
    assert ex[0] == {"instruction": "Say hi.", "input": "", "output": "hi"}
    assert ex[1]["input"] == "1 + 1" and ex[2]["input"] == ""

    with pytest.raises(ValueError, match="not found"):
        load_instruction_data(tmp_path / "missing.jsonl")
    p.write_text(json.dumps({"instruction": "x", "output": "y"}))
    with pytest.raises(ValueError, match="a.json: top-level JSON must be a list"):
        load_instruction_data(p)
    p.write_text(json.dumps([{"instruction": "x", "output": "y"}, {"instruction": "x"}]))
    with pytest.raises(ValueError, match=r"a.json: example 1: missing field 'output'"):
        load_instruction_data(p)
    q = tmp_path / "b.jsonl"
    q.write_text('{"instruction": "x", "output": "y"}\n{"output": "y"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2: missing field 'instruction'"):
        load_instruction_data(q)
    q.write_text('{"instruction": "x", "output": 3}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:1: field 'output' must be a string"):
        load_instruction_data(q)
    q.write_text("\n")
    with pytest.raises(ValueError, match="contains no examples"):
        load_instruction_data(q)


def test_byte_tokenizer_unicode_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 259 and len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    assert max(tok.bos_id, tok.eos_id, tok.pad_id) < tok.vocab_size
    text = "Grüße, 世界! 🚀 naïve café — ok"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def _check_rows(batcher, batch, examples, tok, step, lo=0):
    """Every packed example sits at its offset with prompt -> -100 and response+EOS labelled."""
    for out in range(batch["input_ids"].shape[0]):
        pos = 0
        for i in batcher.row_examples(step, lo + out):
            e = examples[i]
            prompt = [tok.bos_id] + tok.encode(format_prompt(e["instruction"], e["input"]))
            response = tok.encode(e["output"]) + [tok.eos_id]
            n = len(prompt) + len(response)
            assert batch["input_ids"][out, pos:pos + n].tolist() == prompt + response
            assert (batch["labels"][out, pos:pos + len(prompt)] == -100).all()
            assert batch["labels"][out, pos + len(prompt):pos + n].tolist() == response
            assert batch["labels"][out, pos + n - 1].item() == tok.eos_id
            assert tok.decode(batch["labels"][out, pos + len(prompt):pos + n].tolist()) == e["output"]
            pos += n
        assert (batch["attention_mask"][out, :pos] == 1).all()
        assert (batch["attention_mask"][out, pos:] == 0).all()
        assert (batch["labels"][out, pos:] == -100).all()
        assert (batch["input_ids"][out, pos:] == tok.pad_id).all()


def test_instruction_masking_and_padding():
    ex = load_instruction_data(SAMPLE)
    tok = ByteTokenizer()
    b = InstructionBatcher(ex, tok, seq_len=512, global_batch_size=4, seed=0)
    x = b.batch_at(0)
    assert set(x) == {"input_ids", "attention_mask", "labels"}
    lens = x["attention_mask"].sum(1)
    assert x["input_ids"].shape[1] == lens.max().item() <= 512  # padded to the longest row
    assert (lens < lens.max()).any()
    _check_rows(b, x, ex, tok, 0)
    assert "### Response:" in tok.decode(x["input_ids"][0][x["labels"][0] == -100].tolist())


def test_instruction_packing_keeps_per_example_masking():
    ex = load_instruction_data(SAMPLE)
    tok = ByteTokenizer()
    b = InstructionBatcher(ex, tok, seq_len=600, global_batch_size=2, seed=1, pack=True)
    assert b.num_rows < len(ex)
    x = b.batch_at(0)
    assert x["input_ids"].shape[1] <= 600
    assert all(len(b.row_examples(0, r)) >= 2 for r in range(2))
    _check_rows(b, x, ex, tok, 0)
    # one epoch of rows holds every example exactly once
    members = [i for p in range(b.num_rows) for i in b.row_examples(p // 2, p % 2)]
    assert sorted(members) == list(range(len(ex)))


def test_instruction_determinism_and_shards():
    ex = load_instruction_data(SAMPLE)
    tok = ByteTokenizer()
    for pack in (False, True):
        b = InstructionBatcher(ex, tok, seq_len=512, global_batch_size=4, seed=3, pack=pack)
        b2 = InstructionBatcher(ex, tok, seq_len=512, global_batch_size=4, seed=3, pack=pack)
        assert _digest(b.batch_at(5)) == _digest(b2.batch_at(5))
        assert _digest(b.batch_at(5)) != _digest(b.batch_at(6))
        full = b.batch_at(5)
        shards = [b.batch_at(5, shard=(r, 2)) for r in range(2)]
        for k in full:
            assert torch.equal(torch.cat([s[k] for s in shards]), full[k])
        _check_rows(b, shards[1], ex, tok, 5, lo=2)
        with pytest.raises(ValueError, match="not divisible"):
            b.batch_at(0, shard=(0, 3))


def test_instruction_truncation_and_dropping():
    tok = ByteTokenizer()
    ex = [{"instruction": "Short.", "input": "", "output": "x" * 500},
          {"instruction": "Long " * 100, "input": "", "output": "y"}]
    b = InstructionBatcher(ex, tok, seq_len=200, global_batch_size=1, seed=0)
    assert b.num_examples == 1  # the long prompt is dropped
    x = b.batch_at(0)
    assert x["input_ids"].shape == (1, 200)
    assert (x["labels"][0] != -100).sum() > 0 and x["labels"][0, -1].item() == ord("x")
    with pytest.raises(ValueError, match="no response fits; raise seq_len"):
        InstructionBatcher(ex[1:], tok, seq_len=200, global_batch_size=1)
    with pytest.raises(ValueError, match="missing field 'output'"):
        InstructionBatcher([{"instruction": "a"}], tok, seq_len=200, global_batch_size=1)
    with pytest.raises(ValueError, match="examples is empty"):
        InstructionBatcher([], tok, seq_len=200, global_batch_size=1)


def test_instruction_with_hf_tokenizer_dir(hf_tokenizer_dir, tmp_path):
    tok = load_tokenizer(hf_tokenizer_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 2 and tok.pad_id == 0 and tok.bos_id is None
    ex = [{"instruction": "Name the animal.", "input": "", "output": "the quick brown fox"},
          {"instruction": "Where does the cat sleep?", "input": "a small cat", "output": "near the warm fire"}]
    b = InstructionBatcher(ex, tok, seq_len=128, global_batch_size=2, seed=0)
    x = b.batch_at(0)
    for r in range(2):
        e = ex[b.row_examples(0, r)[0]]
        lab = x["labels"][r][x["labels"][r] != -100].tolist()
        assert lab == tok.encode(e["output"]) + [tok.eos_id]
        assert tok.decode(lab) == e["output"]
    # a tokenizer without EOS is rejected with a clear message
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir), local_files_only=True)
    PreTrainedTokenizerFast(tokenizer_object=hf.backend_tokenizer, pad_token="[PAD]",
                            unk_token="[UNK]").save_pretrained(str(tmp_path / "noeos"))
    with pytest.raises(ValueError, match="has no eos token"):
        load_tokenizer(tmp_path / "noeos")
