"""The shared training loop on every plan: same loss curve as serial, the expected collectives,
start-up checks."""

from collections import Counter

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import check_replicated, global_grad_norm, GradientSync
from galaxy.models.bert import BertForMaskedLM
from galaxy.train.loop import train
from galaxy.data.pretraining import mlm_data

SMALL = {"model": {"preset": "bert-tiny", "vocab_size": 300, "hidden_size": 32, "num_attention_heads": 4,
                   "intermediate_size": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
         "train": {"global_batch_size": 4, "seq_length": 24, "max_steps": 20, "lr": 2e-3, "warmup_steps": 2}}


def loss_curve(ctx, plan):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": plan})
    batch_at, _ = mlm_data(cfg)
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=cfg.train.seed)
    return train(model, batch_at, cfg, ctx).losses


def test_each_steps_rows_are_read_once_and_in_order():
    """train() reads the next step's rows while the device runs the optimizer: every step's once, none past
    the last."""
    cfg = GalaxyConfig.from_dict(SMALL, {"max_steps": 4})
    mlm_batch_at, _ = mlm_data(cfg)
    asked = []

    def batch_at(step):
        asked.append(step)
        return mlm_batch_at(step)
    ctx = ParallelContext.serial()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(1), ctx, seed=cfg.train.seed)
    losses = train(model, batch_at, cfg, ctx).losses
    assert asked == [0, 1, 2, 3] and len(losses) == 4


def test_every_plan_logs_the_serial_loss_curve(dist_pool):
    serial = dist_pool.run(loss_curve, 1, "none")[0]
    assert serial[-1] < serial[0]
    for plan in ("tp", "sp", "galaxy", "galaxy2"):
        curves = dist_pool.run(loss_curve, 2, plan)
        assert curves[0] == curves[1], "the loss is replicated: every rank reports the same number"
        for step, (a, b) in enumerate(zip(curves[0], serial)):
            assert abs(a - b) <= 1e-4 * abs(b), f"{plan} step {step + 1}: {a} vs serial {b}"


def count_forward_collectives(ctx, plan, layers):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": plan, "num_hidden_layers": layers, "coc_parallel_num": 1})
    batch_at, _ = mlm_data(cfg)
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx)
    seen = Counter()
    ctx.mp.observers.append(lambda rec: seen.update([(rec.op, rec.phase)]))
    try:
        model(**batch_at(0)).loss.backward()
    finally:
        ctx.mp.observers.clear()
    return dict(seen)


@pytest.mark.parametrize("plan,per_layer", [
    ("galaxy", {("reduce_scatter", "fwd"): 2, ("all_gather", "fwd"): 2,
                ("all_gather", "bwd"): 2, ("reduce_scatter", "bwd"): 2}),
    ("tp", {("all_reduce", "fwd"): 2, ("all_reduce", "bwd"): 2}),
    ("sp", {("all_gather", "fwd"): 1, ("reduce_scatter", "bwd"): 1}),
    ("galaxy2", {("reduce_scatter", "fwd"): 1, ("all_gather", "fwd"): 1,
                 ("all_gather", "bwd"): 1, ("reduce_scatter", "bwd"): 1}),
])
def test_collectives_per_layer(dist_pool, plan, per_layer):
    """Counted by the core's observer hook; one layer's worth is the difference of 2- and 1-layer models."""
    one = dist_pool.run(count_forward_collectives, 2, plan, 1)[0]
    two = dist_pool.run(count_forward_collectives, 2, plan, 2)[0]
    diff = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}
    assert {k: v for k, v in diff.items() if v} == per_layer


def replicated_mismatch(ctx):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": "galaxy"})
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx)
    check_replicated(model, ctx.mp)  # identical by construction
    if ctx.mp.rank == 1:
        with torch.no_grad():
            model.bert.encoder.layer[1].output.LayerNorm.weight[3] += 1e-3
    with pytest.raises(RuntimeError, match="layer.1.output.LayerNorm.weight' differs"):
        check_replicated(model, ctx.mp)
    return True


def test_replicated_weights_are_checked_at_startup(dist_pool):
    assert all(dist_pool.run(replicated_mismatch, 2))


def grad_norm_matches_serial(ctx, plan):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": plan, "seq_scatter_list": [9, 15]})
    batch = mlm_data(cfg)[0](0)
    serial = BertForMaskedLM(cfg.model, seed=1).double()
    serial(**batch).loss.backward()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=1).double()
    model(**batch).loss.backward()
    GradientSync(list(model.parameters()), ctx.mp)()
    expected = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in serial.parameters()))
    got = global_grad_norm(list(model.parameters()), ctx.mp)
    assert abs(got.item() - expected.item()) <= 1e-10 * expected.item()
    return got.item()


@pytest.mark.parametrize("plan", ["tp", "galaxy", "sp"])
def test_global_grad_norm_counts_each_shard_once(dist_pool, plan):
    dist_pool.run(grad_norm_matches_serial, 2, plan)


def replicated_stream_under_dropout(ctx, plan):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": plan, "hidden_dropout_prob": 0.3,
                                         "attention_probs_dropout_prob": 0.3})
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx).train()
    batch = mlm_data(cfg)[0](0)
    hidden = model(**batch).hidden_states.detach()
    off = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx).eval()(**batch).hidden_states.detach()
    assert not torch.allclose(hidden, off), "dropout must be active in train mode"
    return hidden


def test_dropout_masks_in_replicated_regions_are_identical_across_ranks(dist_pool):
    """Under TP the stream (CON.none) is replicated: with dropout on, every rank must still hold
    the same activations, so every rank must draw the same masks there."""
    hidden = dist_pool.run(replicated_stream_under_dropout, 2, "tp")
    assert torch.equal(hidden[0], hidden[1])
