"""Peak host memory of a save, per rank: the sharded writer against format 1's all-on-rank-0 writer.

A 53 M-parameter BERT sharded by TP over N ranks (N = 2, 4) is saved by both writers in the same
processes; each rank measures the growth of its resident set's high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) over its resident size before the save. Format 1 holds the whole
model and its serialized bytes on rank 0; the sharded writer streams each rank's own chunks to its
files, so no rank should grow by more than about 1/N of format 1's rank 0."""

from __future__ import annotations

import ctypes
import gc
import math
import os

import pytest

from galaxy.config import GalaxyConfig
from galaxy.models.bert import BertForMaskedLM
from galaxy.train.checkpoint import legacy, save_checkpoint
from galaxy.train.checkpoint.regions import param_region
from galaxy.train.loop import build_optimizer

LARGE = {"model": {"preset": "bert-tiny", "vocab_size": 1024, "hidden_size": 1024, "num_attention_heads": 16,
                   "intermediate_size": 4096, "num_hidden_layers": 4, "max_position_embeddings": 64},
         "train": {"global_batch_size": 4, "seq_length": 16}}
MIN_PARAMS = 50_000_000


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_growth_bytes(fn) -> int:
    """How far this process's resident set rose above its size before ``fn`` while ``fn`` ran."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: the baseline is what is in use
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def save_both_ways(ctx, directory):
    cfg = GalaxyConfig.from_dict(LARGE, {"plan": "tp"})
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=0)
    optimizer = build_optimizer(model, cfg, ctx)
    full_params = sum(math.prod(param_region(name, p).shape) for name, p in model.named_parameters())
    sharded = peak_growth_bytes(lambda: save_checkpoint(os.path.join(directory, "sharded"), 1, model, optimizer, None,
                                                        ctx, cfg))
    full = peak_growth_bytes(lambda: legacy.save_checkpoint_v1(os.path.join(directory, "full"), 1, model, optimizer,
                                                               None, ctx, cfg))
    return {"params": full_params, "sharded": sharded, "full": full}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_save_needs_about_one_nth_of_rank0s_memory(dist_pool, tmp_path, world):
    results = dist_pool.run(save_both_ways, world, str(tmp_path))
    assert results[0]["params"] >= MIN_PARAMS, results
    rank0_full = results[0]["full"]
    assert rank0_full >= 4 * results[0]["params"], results  # format 1's rank 0 held the whole fp32 model
    print(f"world {world}: " + ", ".join(f"rank {r}: sharded {x['sharded'] / 2**20:.1f} MiB, format 1 "
                                          f"{x['full'] / 2**20:.1f} MiB" for r, x in enumerate(results)))
    for rank, r in enumerate(results):
        assert r["sharded"] <= 1.1 * rank0_full / world, (rank, results)
