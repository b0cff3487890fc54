"""Splitting one step's batch into micro-batches (training and evaluation read it alike)."""

from __future__ import annotations

from galaxy.config import ConfigError


def split_rows(batch: dict, parts: int) -> list[dict]:
    """``parts`` micro-batches of equal rows (every tensor split along dim 0)."""
    rows = next(iter(batch.values())).shape[0]
    if rows % parts:
        raise ConfigError(f"config key 'num_microbatches' ({parts}) does not divide the {rows} rows this rank "
                          "reads per step; use a divisor of global_batch_size / dp_size")
    return [dict(zip(batch, chunk)) for chunk in zip(*(v.chunk(parts) for v in batch.values()))]
