"""Gradient accumulation: ``micro_batch_size`` splits each dp rank's rows into micro-batches whose
gradients add up to one step on the whole batch, in every plan and with PP/DP, and the gradient
sync runs once per optimizer step, not per micro-batch."""

from __future__ import annotations

import pytest

from galaxy.config import GalaxyConfig
from galaxy.core.grad_sync import gather_full
from galaxy.models.bert import BertForMaskedLM
from galaxy.train.loop import Trainer
from galaxy.data.pretraining import mlm_data

BASE = {"model": {"preset": "bert-tiny", "vocab_size": 300, "hidden_size": 48, "num_attention_heads": 4,
                  "intermediate_size": 96, "num_hidden_layers": 2, "hidden_dropout_prob": 0.0,
                  "attention_probs_dropout_prob": 0.0},
        "train": {"global_batch_size": 8, "seq_length": 12, "dtype": "float64", "lr": 1e-3}}

CASES = {
    "serial": (1, {"plan": "none"}),
    "tp3-uneven": (3, {"plan": "tp", "tp_num_attention_heads_list": [2, 1, 1],
                       "tp_intermediate_size_list": [40, 30, 26]}),
    "galaxy-uneven": (2, {"plan": "galaxy", "seq_scatter_list": [7, 5]}),
    "galaxy2": (2, {"plan": "galaxy2"}),
    "sp4": (4, {"plan": "sp"}),
    "pp2": (2, {"plan": "none", "pp_size": 2, "pipeline_schedule": "1f1b"}),
    "dp2-galaxy": (4, {"plan": "galaxy", "dp_size": 2}),
}


def one_step(ctx, overrides: dict):
    cfg = GalaxyConfig.from_dict(BASE, overrides)
    ctx.stage_layers = cfg.stage_layers()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=5)
    trainer = Trainer(model, cfg, ctx)
    sent = {name: comm.bytes_sent for name, comm in (("mp", ctx.mp), ("dp", ctx.dp))}
    loss = trainer.forward_backward(trainer.read_batch(mlm_data(cfg)[0], 0)).item()
    sent = {name: comm.bytes_sent - sent[name] for name, comm in (("mp", ctx.mp), ("dp", ctx.dp))}
    grads = {n: gather_full(p.grad, p, ctx.mp) for n, p in model.named_parameters() if p.grad is not None}
    trainer.grad_sync.remove()
    return loss, grads, trainer.num_microbatches, sent


def accumulation_equals_one_step(ctx, overrides: dict):
    whole = one_step(ctx, overrides)
    split = one_step(ctx, dict(overrides, micro_batch_size=1))
    return whole, split


@pytest.mark.parametrize("case", CASES)
def test_accumulated_micro_batches_equal_one_step(dist_pool, case):
    world, overrides = CASES[case]
    dp, pp = overrides.get("dp_size", 1), overrides.get("pp_size", 1)
    for (loss, grads, m1, sent1), (loss_k, grads_k, mk, sent_k) in \
            dist_pool.run(accumulation_equals_one_step, world, overrides, dp=dp, pp=pp):
        assert (m1, mk) == (1, 8 // dp), "micro_batch_size 1 makes one micro-batch per row"
        assert abs(loss - loss_k) <= 1e-12 * abs(loss)
        assert grads.keys() == grads_k.keys() and grads
        for name, g in grads.items():
            # floor: a key bias's gradient is exactly zero in exact arithmetic, roundoff in practice
            err = ((grads_k[name] - g).norm() / g.norm().clamp(min=1e-6)).item()
            assert err < 1e-9, f"{case}: gradient of {name} differs by {err:.1e}"
        # The dp buckets are reduced once per step, however many micro-batches: the same bytes.
        assert sent_k["dp"] == sent1["dp"], (sent_k, sent1)
