"""Every ATT x CON x MLP plan at world 1-4, even and uneven splits, equals the serial BERT:
output, loss and every parameter gradient (gathered to full shape) in float64 to 1e-9 relative,
and the parameters after 3 AdamW steps."""

import itertools

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.grad_sync import GradientSync, gather_full
from galaxy.models.bert import BertForMaskedLM, BertForSequenceClassification

TINY = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=40,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ, BATCH = 11, 3
UNEVEN = {
    2: dict(tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[15, 25], seq_scatter_list=[7, 4]),
    3: dict(tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10], seq_scatter_list=[2, 5, 4]),
    4: dict(tp_num_attention_heads_list=[2, 1, 2, 1], tp_intermediate_size_list=[5, 10, 15, 10],
            seq_scatter_list=[3, 2, 4, 2]),
}
COMBOS = list(itertools.product(("TP", "SP", "None"), ("SP", "None"), ("TP", "SP", "None")))
RTOL = 1e-9
TINY_INIT_STD = 0.02


def rel_err(a, b, floor=1e-6):
    # A floor on the denominator: some exact gradients are zero (a key bias shifts every score
    # of a query equally), where rounding noise of 1e-17 must not read as a relative error of 1.
    return ((a - b).norm() / b.norm().clamp(min=floor)).item()


def make_batch(step, classify=False):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(5, TINY["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0  # padding matters
    if classify:
        labels = torch.randint(0, 2, (BATCH,), generator=g)
    else:
        labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[0, 0] = ids[0, 0]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def compare_with_serial(ctx, methods, uneven, classify=False, steps=3, pooling="cls", extra=None):
    att, con, mlp = methods
    raw = dict(TINY, att_parallel_method=att, con_parallel_method=con, mlp_parallel_method=mlp, seq_length=SEQ,
               classifier_pooling=pooling, **(extra or {}))
    if uneven:
        raw.update(UNEVEN[ctx.mp.size])
    cfg = GalaxyConfig.from_dict(raw)
    plan = cfg.resolve_plan(ctx.mp.size)
    cls = BertForSequenceClassification if classify else BertForMaskedLM
    serial = cls(cfg.model, seed=7).double()
    par = cls(cfg.model, plan, ctx, seed=7).double()
    sync = GradientSync(par.parameters(), ctx.mp)
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.01)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.01)
    worst = 0.0
    for step in range(steps + 1):
        batch = make_batch(step, classify)
        out_s, out_p = serial(**batch), par(**batch)
        out_s.loss.backward()
        out_p.loss.backward()
        sync()
        if step == 0:
            assert abs(out_p.loss.item() - out_s.loss.item()) <= RTOL * abs(out_s.loss.item()), \
                (out_p.loss.item(), out_s.loss.item())
            logits = out_p.logits if classify else par.bert.stream.to_replicated(out_p.logits)
            worst = max(worst, rel_err(logits.detach(), out_s.logits.detach()))
            grads_s = dict(serial.named_parameters())
            for name, p in par.named_parameters():
                full = gather_full(p.grad, p, ctx.mp)
                err = rel_err(full, grads_s[name].grad)
                assert err < RTOL, f"grad of {name}: relative error {err:.2e}"
                worst = max(worst, err)
        if step == steps:
            break
        opt_s.step()
        opt_p.step()
        opt_s.zero_grad()
        opt_p.zero_grad()
    params_s = dict(serial.named_parameters())
    for name, p in par.named_parameters():
        # Parameters are measured against their init scale: a zero-init key bias has no gradient,
        # and Adam turns its 1e-17 rounding noise into tiny updates of either sign.
        floor = TINY_INIT_STD * params_s[name].numel() ** 0.5
        err = rel_err(gather_full(p.detach(), p, ctx.mp), params_s[name].detach(), floor)
        assert err < RTOL, f"{name} after {steps} AdamW steps: relative error {err:.2e}"
    assert worst < RTOL
    return worst


@pytest.mark.parametrize("methods", COMBOS, ids=["-".join(c) for c in COMBOS])
@pytest.mark.parametrize("world,uneven", [(1, False), (2, False), (2, True), (3, False), (3, True), (4, False),
                                          (4, True)])
def test_plan_equals_serial(dist_pool, methods, world, uneven):
    dist_pool.run(compare_with_serial, world, methods, uneven)


@pytest.mark.parametrize("plan", [("TP", "SP", "TP"), ("SP", "SP", "SP"), ("TP", "None", "TP")])
def test_classification_equals_serial(dist_pool, plan):
    dist_pool.run(compare_with_serial, 3, plan, True, True, 1)


@pytest.mark.parametrize("plan", [("TP", "SP", "TP"), ("SP", "SP", "SP")])
def test_mean_pooled_classification_equals_serial(dist_pool, plan):
    """``classifier_pooling: mean`` over padded rows: each sequence shard sums its own real tokens."""
    dist_pool.run(compare_with_serial, 3, plan, True, True, 1, "mean")


def test_mean_pooling_is_the_mean_of_the_real_tokens():
    cfg = GalaxyConfig.from_dict(dict(TINY, seq_length=SEQ, classifier_pooling="mean"))
    model = BertForSequenceClassification(cfg.model, seed=7).double().eval()
    batch = make_batch(0, classify=True)
    h = model.bert(batch["input_ids"], batch["attention_mask"])
    mask = batch["attention_mask"].double()
    want = torch.stack([h[i][mask[i] > 0].mean(0) for i in range(h.shape[0])])
    assert torch.allclose(model.bert.mean_token(h, batch["attention_mask"]), want, rtol=0, atol=1e-12)
    with pytest.raises(ConfigError, match="classifier_pooling"):
        GalaxyConfig.from_dict(dict(TINY, seq_length=SEQ, classifier_pooling="max"))
