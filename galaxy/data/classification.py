"""Sequence-classification data: labelled JSONL and batches, a pure function of the step."""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import torch

from galaxy.data.batching import EpochPermutation, check_int, shard_bounds
from galaxy.errors import DataError


def load_labelled_data(path: str | os.PathLike) -> list[tuple[str, int]]:
    """``(text, label)`` pairs from a JSONL file of ``{"text": str, "label": int >= 0}`` objects."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"labelled data file {path!r} does not exist; give a .jsonl file of "
                        '{"text": ..., "label": ...} lines')
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f'{path}:{n}: each line must be an object with a string "text" field')
            label = obj.get("label")
            if not isinstance(label, int) or isinstance(label, bool) or label < 0:
                raise DataError(f'{path}:{n}: "label" must be a non-negative integer class id, got {label!r}')
            pairs.append((obj["text"], label))
    if not pairs:
        raise DataError(f"labelled data file {path!r} holds no examples")
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
        check_int("ClassificationBatcher seq_len", seq_len, 3)
        check_int("ClassificationBatcher global_batch_size", global_batch_size, 1)
        if not examples:
            raise ValueError("ClassificationBatcher: no examples")
        self.seq_len, self.global_batch_size, self.pad_id = seq_len, global_batch_size, pad_id
        self._rows = [[cls_id] + list(encode(text))[:seq_len - 2] + [sep_id] for text, _ in examples]
        self._labels = [label for _, label in examples]
        self.num_examples = len(self._rows)
        self.num_labels = max(self._labels) + 1
        self._order = EpochPermutation(self.num_examples, seed, "classify-order")

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        check_int("step", step, 0)
        lo, hi = shard_bounds(self.global_batch_size, shard)
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
