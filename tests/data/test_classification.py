"""Sequence-classification data (``galaxy.data.classification``): labelled JSONL read or refused with the
file and line, and batches that are ``[CLS] tokens [SEP]`` right-padded, visit every example once an
epoch, and split into data-parallel shards that put the global batch back together."""

from collections import Counter

import pytest
import torch

from galaxy.data.classification import ClassificationBatcher, load_labelled_data
from galaxy.errors import DataError

CLS, SEP, PAD = 101, 102, 0


def encode(text):
    return [len(word) + 10 for word in text.split()]  # one token a word, its length shifted past the specials


def test_labelled_lines_are_read_and_bad_ones_named(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a b", "label": 1}\n\n{"text": "c", "label": 0}\n')
    assert load_labelled_data(good) == [("a b", 1), ("c", 0)]
    for body, says in (('{"text": "a", "label": -1}\n', "bad.jsonl:1: \"label\" must be a non-negative"),
                       ('{"text": "a", "label": 0}\n{"text": 3, "label": 0}\n', 'bad.jsonl:2: each line'),
                       ('{"text": "a", "label": true}\n', "non-negative integer"),
                       ("{oops\n", "bad.jsonl:1: not valid JSON"), ("\n", "holds no examples")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(DataError, match=says.replace("(", r"\(")):
            load_labelled_data(bad)
    with pytest.raises(DataError, match="does not exist"):
        load_labelled_data(tmp_path / "missing.jsonl")


def test_batches_visit_every_example_once_an_epoch_and_shards_make_the_batch():
    examples = [(" ".join("w" * (1 + (i + j) % 4) for j in range(i % 7)), i % 3) for i in range(12)]
    batcher = ClassificationBatcher(examples, encode, seq_len=6, global_batch_size=4, cls_id=CLS, sep_id=SEP,
                                    pad_id=PAD, seed=3)
    assert batcher.num_examples == 12 and batcher.num_labels == 3
    expected = Counter()
    for text, label in examples:  # what each example's row must be: [CLS] tokens cut to 4 [SEP] padding
        row = [CLS] + encode(text)[:4] + [SEP]
        expected[tuple(row + [PAD] * (6 - len(row))), label] += 1
    seen = Counter()
    for step in range(3):  # one epoch: 12 examples in batches of 4
        batch = batcher.batch_at(step)
        assert torch.equal(batch["attention_mask"], (batch["input_ids"] != PAD).long())
        for ids, label in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
            seen[tuple(ids), label] += 1
        shards = [batcher.batch_at(step, (r, 2)) for r in range(2)]
        for key in batch:
            assert torch.equal(torch.cat([s[key] for s in shards]), batch[key])
    assert seen == expected
    assert not torch.equal(batcher.batch_at(3)["input_ids"], batcher.batch_at(0)["input_ids"])  # a new permutation
