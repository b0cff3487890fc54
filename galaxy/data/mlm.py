"""Masked-LM batches (BERT pretraining), a pure function of the step."""

from __future__ import annotations

from typing import Any

import torch

from galaxy.data.batching import IGNORE_INDEX, RowStream, check_int, check_split, seeded_generator


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
        check_int("MLMBatcher global_batch_size", global_batch_size, 1)
        check_int("MLMBatcher seed", seed, 0)
        if not isinstance(mlm_probability, (int, float)) or not 0.0 < mlm_probability <= 1.0:
            raise ValueError(f"MLMBatcher mlm_probability must be in (0, 1], got {mlm_probability!r}")
        self.corpus = corpus
        self.global_batch_size = global_batch_size
        self.mlm_probability = float(mlm_probability)
        self.seed = seed
        self.split = check_split(split)
        self.seq_len = corpus.seq_len
        self.num_sequences = corpus.num_sequences(split)
        if self.num_sequences is not None and self.num_sequences < 1:
            raise ValueError(f"MLMBatcher: the corpus has no {split!r} sequences; for TextCorpus add "
                             f"documents or raise eval_fraction")
        self._special = torch.tensor(sorted(corpus.special_ids), dtype=torch.long)
        pool = [i for i in range(corpus.vocab_size) if i not in corpus.special_ids]
        if not pool:
            raise ValueError("MLMBatcher: the corpus vocabulary has no non-special token to sample")
        self._random_pool = torch.tensor(pool, dtype=torch.long)
        self._rows = RowStream(self.num_sequences, global_batch_size, seed, "mlm-order", split,
                               who=f"MLMBatcher ({split} sequences)")

    @property
    def steps_per_epoch(self) -> int | None:
        """Full batches per pass over the split (None for an unbounded corpus)."""
        return self._rows.steps_per_epoch

    def sequence_index(self, step: int, row: int) -> int:
        """Index (within the split) of the sequence in global row ``row`` of ``step``."""
        return self._rows(step, row)

    def batch_at(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` (1 real / 0 pad) and ``labels`` (-100 where not
        predicted), LongTensors ``[rows, seq_len]``; rows = the whole global batch, or the
        contiguous slice of data-parallel shard ``(dp_rank, dp_size)``."""
        lo, hi, items = self._rows.rows(step, shard)
        B, S = self.global_batch_size, self.seq_len

        ids = torch.full((hi - lo, S), self.corpus.pad_id, dtype=torch.long)
        attention = torch.zeros((hi - lo, S), dtype=torch.long)
        for out, index in enumerate(items):
            seq = self.corpus.get_sequence(index, self.split)
            if len(seq) > S:
                raise ValueError(f"corpus returned a sequence of {len(seq)} tokens > seq_len={S}")
            ids[out, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[out, :len(seq)] = 1

        gen = seeded_generator(self.seed, "mlm-mask", self.split, step)
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
