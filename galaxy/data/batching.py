"""What every batcher shares: stable seeds, data-parallel row shards and epoch orders.

Randomness never touches the global RNGs: every draw comes from a fresh ``torch.Generator`` seeded
with a stable hash of a tuple such as ``(seed, "mlm", split, step)``, so a batch is a pure function
of its step, the same in every process, and resuming from a step is exact.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

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
