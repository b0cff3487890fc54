"""galaxy.data.causal: packed causal-LM windows, deterministic, dp-shardable, split by document."""

from __future__ import annotations

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.data.batching import IGNORE_INDEX
from galaxy.data.causal import CausalLMBatcher, SyntheticWindows, TokenWindows
from galaxy.data.pretraining import causal_lm_data
from galaxy.data.tokenizer import train_wordpiece

EOS, PAD = 3, 0


def _token_docs(n: int, seed: int = 0) -> list[list[int]]:
    """Documents of distinct content ids (each doc's ids identify it): doc i holds 100*(i+1) + k."""
    g = torch.Generator().manual_seed(seed)
    return [[100 * (i + 1) + k for k in range(int(torch.randint(1, 12, (1,), generator=g)))] for i in range(n)]


def _windows(train, evals=(), seq_len=8):
    return TokenWindows(train, list(evals), seq_len=seq_len, vocab_size=100 * (len(train) + len(evals) + 2),
                        pad_id=PAD, eos_id=EOS)


def test_text_windows_are_the_eos_joined_stream_cut_in_order():
    docs = _token_docs(9)
    w = _windows(docs, seq_len=8)
    stream = [t for d in docs for t in d + [EOS]]
    n = w.num_windows("train")
    assert n == -(-len(stream) // 8)
    got = [w.window(i) for i in range(n)]
    assert all(len(x) == 8 for x in got[:-1]) and 1 <= len(got[-1]) <= 8
    assert [t for x in got for t in x] == stream
    # every end-of-text id stands right after the last token of a document, and nowhere else
    flat = [t for x in got for t in x]
    ends = [i for i, t in enumerate(flat) if t == EOS]
    assert [flat[i - 1] for i in ends] == [d[-1] for d in docs]


def test_text_batches_pad_the_last_window_and_labels_are_the_inputs():
    docs = _token_docs(7)
    w = _windows(docs, seq_len=8)
    n = w.num_windows("train")
    b = CausalLMBatcher(w, n, seed=3)
    batch = b.batch_at(0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["labels"][real], batch["input_ids"][real])
    assert (batch["labels"][~real] == IGNORE_INDEX).all() and (batch["input_ids"][~real] == PAD).all()
    # one epoch is every window once, so the real tokens are exactly the stream's
    assert int(real.sum()) == sum(len(d) + 1 for d in docs)
    rows = sorted(b.window_index(0, r) for r in range(n))
    assert rows == list(range(n))
    short = len(w.window(n - 1))
    padded_rows = (~real).any(dim=1).nonzero().flatten().tolist()
    assert padded_rows == ([] if short == 8 else [[b.window_index(0, r) for r in range(n)].index(n - 1)])


def test_batches_are_deterministic_per_seed_step_and_row():
    w = SyntheticWindows(300, 32, seed=5)
    a, b = CausalLMBatcher(w, 8, seed=1), CausalLMBatcher(SyntheticWindows(300, 32, seed=5), 8, seed=1)
    for step in (0, 3, 11):
        x, y = a.batch_at(step), b.batch_at(step)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert not torch.equal(a.batch_at(0)["input_ids"], a.batch_at(1)["input_ids"])
    other_seed = CausalLMBatcher(SyntheticWindows(300, 32, seed=6), 8, seed=1)
    assert not torch.equal(a.batch_at(0)["input_ids"], other_seed.batch_at(0)["input_ids"])
    # the text source's epoch order depends on the batcher's seed, and is the same for the same seed
    t = _windows(_token_docs(40), seq_len=8)
    orders = [[CausalLMBatcher(t, 4, seed=s).window_index(2, r) for r in range(4)] for s in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2]


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_dp_shards_partition_the_global_batch(dp_size, source):
    w = SyntheticWindows(300, 16, seed=0) if source == "synthetic" else _windows(_token_docs(30), seq_len=16)
    b = CausalLMBatcher(w, 8, seed=2)
    for step in (0, 5):
        full = b.batch_at(step)
        shards = [b.batch_at(step, shard=(r, dp_size)) for r in range(dp_size)]
        assert all(s["input_ids"].shape[0] == 8 // dp_size for s in shards)
        for k in full:
            assert torch.equal(torch.cat([s[k] for s in shards]), full[k])


def test_shard_and_step_errors():
    b = CausalLMBatcher(SyntheticWindows(300, 16), 6)
    with pytest.raises(ValueError, match="not divisible by dp_size=4"):
        b.batch_at(0, shard=(0, 4))
    with pytest.raises(ValueError, match="step"):
        b.batch_at(-1)
    with pytest.raises(ValueError, match="has no attribute 'seq_len'"):
        CausalLMBatcher(object(), 4)
    with pytest.raises(ValueError, match="no 'eval' windows"):
        CausalLMBatcher(_windows(_token_docs(3)), 4, split="eval")


def test_synthetic_windows_are_full_packed_documents():
    w = SyntheticWindows(300, 40, seed=0)
    assert w.num_windows("train") is None and w.eos_id == EOS and w.pad_id == PAD
    for i in (0, 1, 17):
        docs, window = w.documents(i), w.window(i)
        assert len(window) == 40 and len(docs) >= 2  # documents are 18..38 tokens: every window holds a boundary
        assert window == [t for d in docs for t in d + [EOS]][:40]
        assert all(t >= 5 for d in docs for t in d)  # content ids only; the end-of-text id separates them
    assert w.window(0, "train") != w.window(0, "eval")
    b = CausalLMBatcher(w, 4)
    assert bool(b.batch_at(0)["attention_mask"].all())


def test_held_out_split_is_by_document_before_packing():
    texts = [f"document{i} " + " ".join(["alpha beta gamma delta"] * (1 + i % 3)) for i in range(20)]
    tok = train_wordpiece(texts, 200)
    w = TokenWindows.from_texts(texts, 16, tokenizer=tok, eval_fraction=0.1)
    assert w.eos_id == tok.token_to_id("[SEP]") and w.pad_id == tok.token_to_id("[PAD]")
    assert w.num_documents == {"train": 18, "eval": 2}
    train = [t for i in range(w.num_windows("train")) for t in w.window(i, "train")]
    evals = [t for i in range(w.num_windows("eval")) for t in w.window(i, "eval")]
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert train == [t for s in texts[:18] for t in encode(s) + [w.eos_id]]
    assert evals == [t for s in texts[18:] for t in encode(s) + [w.eos_id]]


def test_config_data_with_a_text_file_and_held_out_split(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(f"line {i} the quick brown fox jumps over the lazy dog" for i in range(30)) + "\n")
    cfg = GalaxyConfig.from_dict({"model": {"preset": "llama-tiny", "vocab_size": 120},
                                  "train": {"global_batch_size": 4, "seq_length": 16, "eval_every": 1},
                                  "data": {"data": str(data)}})
    batch_at, eval_at, vocab = causal_lm_data(cfg)
    assert vocab <= 120 and eval_at is not None
    for batch in (batch_at(0), eval_at(0)):
        assert batch["input_ids"].shape == (4, 16) and int(batch["input_ids"].max()) < vocab
    one = tmp_path / "one.txt"
    one.write_text("a single document\n")
    cfg.data.data = str(one)
    with pytest.raises(ConfigError, match="'eval_every' needs held-out text"):
        causal_lm_data(cfg)
