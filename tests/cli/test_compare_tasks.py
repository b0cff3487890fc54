"""What ``compare_tuning.py`` fine-tunes on (``galaxy.cli.compare_tasks``): the generated topic task is a pure
function of its seed whose documents lean on their topic's words, written as JSONL that
``load_labelled_data`` reads back; the causal-LM pretraining batches are each text's bytes between BOS and
EOS, padding ignored, split into data-parallel shards that make the batch."""

import torch

from galaxy.cli.compare_tasks import TOPICS, causal_lm_batches, topic_documents, write_topic_task
from galaxy.config import GalaxyConfig
from galaxy.data.batching import IGNORE_INDEX
from galaxy.data.classification import load_labelled_data
from galaxy.data.tokenizer import ByteTokenizer


def test_topic_documents_lean_on_their_topics_words(tmp_path):
    docs = topic_documents(300, seed=5)
    assert docs == topic_documents(300, seed=5) and docs != topic_documents(300, seed=6)
    assert {label for _, label in docs} == set(range(TOPICS))
    own = other = total = 0
    for text, label in docs:
        words = text.split()
        assert 12 <= len(words) <= 28
        # a topic's words end in its number; filler words end in a letter
        own += sum(w.endswith(str(label)) for w in words)
        other += sum(w[-1].isdigit() and not w.endswith(str(label)) for w in words)
        total += len(words)
    assert own / total > 0.3 and other / total < 0.05  # about 0.34 and 0.04 by construction
    train, held_out = write_topic_task(str(tmp_path), n_train=20, n_eval=10, seed=5)
    assert load_labelled_data(train) == topic_documents(20, 6) and load_labelled_data(held_out) == topic_documents(10, 7)


def test_causal_lm_batches_are_the_texts_bytes_with_padding_ignored():
    cfg = GalaxyConfig.from_dict({"preset": "llama-tiny", "seq_length": 12, "global_batch_size": 4})
    texts = ["hi", "a longer text than twelve", "xyz", "q", "abcde"]
    batch_at = causal_lm_batches(texts, cfg)
    tok = ByteTokenizer()
    rows = {tuple(([tok.bos_id] + tok.encode(t) + [tok.eos_id])[:12]) for t in texts}
    batch = batch_at(0)
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        n = int(mask.sum())
        assert tuple(ids[:n].tolist()) in rows and mask[:n].all() and (ids[n:] == tok.pad_id).all()
        assert torch.equal(labels[:n], ids[:n]) and (labels[n:] == IGNORE_INDEX).all()
    halves = [batch_at(0, (r, 2)) for r in range(2)]
    for key in batch:
        assert torch.equal(torch.cat([h[key] for h in halves]), batch[key])
