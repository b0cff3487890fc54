"""What every batcher shares: stable seeds, data-parallel row shards and epoch orders.

Randomness never touches the global RNGs: every draw comes from a fresh ``torch.Generator`` seeded
with a stable hash of a tuple such as ``(seed, "mlm", split, step)``, so a batch is a pure function
of its step, the same in every process, and resuming from a step is exact.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # labels the loss skips (torch's and transformers' convention)
SPLITS = ("train", "eval")


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from a tuple of ints/strings (same in every process and platform)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_generator(*parts: Any) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(*parts))
    return gen


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split


def shard_bounds(global_batch_size: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    """Contiguous rows [lo, hi) of the global batch owned by data-parallel shard (rank, size)."""
    if shard is None:
        return 0, global_batch_size
    try:
        dp_rank, dp_size = shard
    except (TypeError, ValueError):
        raise ValueError(f"shard must be a (dp_rank, dp_size) pair, got {shard!r}") from None
    check_int("shard dp_size", dp_size, 1)
    check_int("shard dp_rank", dp_rank, 0)
    if dp_rank >= dp_size:
        raise ValueError(f"shard dp_rank={dp_rank} must be < dp_size={dp_size}")
    if global_batch_size % dp_size != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}; "
            f"choose a global batch size that is a multiple of the data-parallel size"
        )
    per = global_batch_size // dp_size
    return dp_rank * per, (dp_rank + 1) * per


class EpochPermutation:
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
            perm = torch.randperm(self.num_items, generator=seeded_generator(*self._tag, epoch)).tolist()
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm[offset]


class RowStream:
    """Which item of a split fills global row ``row`` of step ``step``: position ``step*B + row`` of
    the split's stream, B the global batch size. A finite split (``num_items``) is visited epoch by
    epoch, each in a permutation seeded by ``(*tag, epoch)``; an unbounded one (``num_items`` None,
    a generated stream) is read in order. ``rows(step, shard)`` gives a data-parallel shard's
    contiguous slice of the global batch's rows, so the shards concatenate to exactly the global
    batch. ``who`` names the batcher in errors."""

    def __init__(self, num_items: int | None, global_batch_size: int, *tag: Any, who: str = "batcher") -> None:
        check_int(f"{who} global_batch_size", global_batch_size, 1)
        if num_items is not None and num_items < 1:
            raise ValueError(f"{who}: the split has no items to batch; add documents or lower the held-out share")
        if num_items is not None and num_items < global_batch_size:
            logger.warning("%s: %d items < global_batch_size=%d; items repeat within a batch", who, num_items,
                           global_batch_size)
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self._order = EpochPermutation(num_items, *tag) if num_items is not None else None

    @property
    def steps_per_epoch(self) -> int | None:
        """Full batches per pass over the split (None for an unbounded one)."""
        return None if self.num_items is None else max(1, self.num_items // self.global_batch_size)

    def __call__(self, step: int, row: int) -> int:
        position = step * self.global_batch_size + row
        return position if self._order is None else self._order(position)

    def rows(self, step: int, shard: tuple[int, int] | None) -> tuple[int, int, list[int]]:
        """``(lo, hi, items)``: this shard's global rows ``[lo, hi)`` of ``step`` and their items."""
        check_int("step", step, 0)
        lo, hi = shard_bounds(self.global_batch_size, shard)
        return lo, hi, [self(step, r) for r in range(lo, hi)]
