"""A step's batch as the model reads it: split into micro-batches (training and evaluation alike),
without an attention mask that changes nothing the loss sees."""

from __future__ import annotations

from galaxy.config import ConfigError
from galaxy.data.batching import IGNORE_INDEX


def without_needless_mask(batch: dict, causal: bool) -> dict:
    """``batch`` without its ``attention_mask`` where no output that reaches the loss depends on it: a mask of
    all ones (any model), or, for a causal LM, right padding whose positions carry no label: causal attention
    already keeps every real token from the padding after it, and the padding's own outputs meet only ignored
    labels. Attention then runs SDPA's causal kernel instead of a masked one (forward + backward 3.2x slower
    on an H200 at seq 4096: ~600 ms of a 7B step at TP 2, docs/benchmarks-log.md). Checked on the host."""
    mask = batch.get("attention_mask")
    if mask is None:
        return batch
    if not bool(mask.all()):
        labels = batch.get("labels")
        right_padded = bool((mask[:, 1:] <= mask[:, :-1]).all())
        if not (causal and right_padded and labels is not None and labels.shape == mask.shape
                and bool((labels[mask == 0] == IGNORE_INDEX).all())):
            return batch
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def split_rows(batch: dict, parts: int) -> list[dict]:
    """``parts`` micro-batches of equal rows (every tensor split along dim 0)."""
    rows = next(iter(batch.values())).shape[0]
    if rows % parts:
        raise ConfigError(f"config key 'num_microbatches' ({parts}) does not divide the {rows} rows this rank "
                          "reads per step; use a divisor of global_batch_size / dp_size")
    return [dict(zip(batch, chunk)) for chunk in zip(*(v.chunk(parts) for v in batch.values()))]
