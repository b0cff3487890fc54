"""Every ATT x CON x MLP plan equals the serial LLaMA in float64: loss, logits and every parameter
gradient (gathered to full shape) to 1e-9 relative after one GradientSync step, with GQA,
causal + padding masks, even and uneven splits, tied and untied embeddings. Greedy generation
on every plan (SP ones with the KV cache) equals the serial one token for token."""

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.grad_sync import GradientSync, gather_full
from galaxy.models.generation import generate
from galaxy.models import model_class

# 8 query heads sharing 4 key/value heads: GQA groups of 2.
TINY = dict(model_type="llama", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=40, hidden_act="silu", max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1)
SEQ, BATCH = 11, 3
UNEVEN = {
    2: dict(tp_num_attention_heads_list=[6, 2], tp_intermediate_size_list=[15, 25], seq_scatter_list=[7, 4]),
    3: dict(tp_num_attention_heads_list=[2, 4, 2], tp_intermediate_size_list=[10, 20, 10], seq_scatter_list=[2, 5, 4]),
    4: dict(tp_num_attention_heads_list=[2, 2, 2, 2], tp_intermediate_size_list=[5, 10, 15, 10],
            seq_scatter_list=[3, 2, 4, 2]),
}
PRESETS = ("none", "tp", "sp", "galaxy", "galaxy2")
RTOL = 1e-9


def rel_err(a, b, floor=1e-6):
    # A floor on the denominator, so rounding noise on an exactly-zero gradient is not read as 100%.
    return ((a - b).norm() / b.norm().clamp(min=floor)).item()


def make_batch():
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0  # right padding
    mask[2, :2] = 0  # left padding: a fully masked causal row must not break anything
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    labels[0, 4] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def build(ctx, plan_spec, uneven, extra=None):
    raw = dict(TINY, seq_length=SEQ, **(extra or {}))
    if isinstance(plan_spec, str):
        raw["plan"] = plan_spec
    else:
        raw.update(att_parallel_method=plan_spec[0], con_parallel_method=plan_spec[1], mlp_parallel_method=plan_spec[2])
    if uneven:
        raw.update(UNEVEN[ctx.mp.size])
    cfg = GalaxyConfig.from_dict(raw)
    cls = model_class(cfg.model.model_type)  # LLaMA, or a family with LLaMA's config keys (extra model_type)
    serial = cls(cfg.model, seed=3).double()
    par = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double()
    return serial, par


def backward_both(serial, par, batch, ctx, edges):
    """Forward and backward of the serial and the parallel model on one batch, the parallel
    gradients synced by their rules; the losses must agree. Returns the parallel model's loss and
    the relative error of its logits (``edges``: the parallel model's block boundaries)."""
    sync = GradientSync(par.parameters(), ctx.mp)
    out_s, out_p = serial(**batch), par(**batch)
    out_s.loss.backward()
    out_p.loss.backward()
    sync()
    assert abs(out_p.loss.item() - out_s.loss.item()) <= RTOL * abs(out_s.loss.item()), \
        (out_p.loss.item(), out_s.loss.item())
    return out_p.loss.item(), rel_err(edges.to_replicated(out_p.logits).detach(), out_s.logits.detach())


def compare_with_serial(ctx, plan_spec, uneven, extra=None):
    serial, par = build(ctx, plan_spec, uneven, extra)
    _, worst = backward_both(serial, par, make_batch(), ctx, par.model.stream)
    grads_s = dict(serial.named_parameters())
    assert set(grads_s) == {n for n, _ in par.named_parameters()}
    for name, p in par.named_parameters():
        err = rel_err(gather_full(p.grad, p, ctx.mp), grads_s[name].grad)
        assert err < RTOL, f"grad of {name}: relative error {err:.2e}"
        worst = max(worst, err)
    assert worst < RTOL, worst
    return worst


@pytest.mark.parametrize("plan", PRESETS)
@pytest.mark.parametrize("world", [2, 4])
def test_preset_equals_serial(dist_pool, plan, world):
    dist_pool.run(compare_with_serial, world, plan, False)


@pytest.mark.parametrize("plan", PRESETS)
def test_uneven_world3_equals_serial(dist_pool, plan):
    dist_pool.run(compare_with_serial, 3, plan, True)


MIXED = [("SP", "None", "TP"), ("TP", "None", "SP"), ("None", "SP", "TP"), ("SP", "SP", "TP")]


@pytest.mark.parametrize("methods", MIXED, ids=["-".join(m) for m in MIXED])
@pytest.mark.parametrize("world", [2, 3])
def test_mixed_uneven_equals_serial(dist_pool, methods, world):
    dist_pool.run(compare_with_serial, world, methods, True)


@pytest.mark.parametrize("plan", ["galaxy", "sp", "tp"])
def test_tied_and_scaled_rope_equal_serial(dist_pool, plan):
    extra = dict(tie_word_embeddings=True, rope_theta=500.0,
                 rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8))
    dist_pool.run(compare_with_serial, 4, plan, True, extra)


def generate_on_plan(ctx, plan_spec, uneven, extra=None):
    serial, par = build(ctx, plan_spec, uneven, extra)
    ids = make_batch()["input_ids"][:, :5]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    want = generate(serial, ids, 6, attention_mask=mask)
    got = generate(par, ids, 6, attention_mask=mask)
    assert torch.equal(got, want), (got, want)
    return got


@pytest.mark.parametrize("plan_spec", ["tp", ("TP", "None", "None")])
def test_generate_on_tp_plan_equals_serial(dist_pool, plan_spec):
    dist_pool.run(generate_on_plan, 3, plan_spec, True)


def generate_on_sp_plan(ctx, plan_spec, uneven, extra=None):
    """The prefill splits the whole prompt (SEQ tokens, left-padded rows included) as the plan says;
    every later step runs its token replicated against the cache."""
    serial, par = build(ctx, plan_spec, uneven, extra)
    batch = make_batch()
    ids, mask = batch["input_ids"], torch.ones_like(batch["input_ids"])
    mask[2, :3] = 0
    want = generate(serial, ids, 6, attention_mask=mask)
    got = generate(par, ids, 6, attention_mask=mask)
    assert torch.equal(got, want), (got, want)
    with pytest.raises(ValueError, match="use_cache=True"):
        generate(par, ids, 2, use_cache=False)
    return got


@pytest.mark.parametrize("plan_spec,world,uneven", [("galaxy", 2, False), ("sp", 3, True), ("galaxy2", 3, True),
                                                    ("galaxy", 3, True), (("SP", "None", "TP"), 2, True)])
def test_generate_on_sp_plan_equals_serial(dist_pool, plan_spec, world, uneven):
    dist_pool.run(generate_on_sp_plan, world, plan_spec, uneven)


def test_head_split_breaking_gqa_group_is_a_config_error():
    cfg = GalaxyConfig.from_dict(dict(TINY, seq_length=SEQ, plan="tp", tp_num_attention_heads_list=[3, 5]))
    with pytest.raises(ConfigError, match="multiple of 2"):
        cfg.resolve_plan(2)
    # The balanced split of 8 heads over 3 ranks is [3, 3, 2]: also refused.
    with pytest.raises(ConfigError, match="tp_num_attention_heads_list"):
        GalaxyConfig.from_dict(dict(TINY, seq_length=SEQ, plan="galaxy")).resolve_plan(3)
