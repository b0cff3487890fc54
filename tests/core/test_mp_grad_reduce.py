"""``mp_grad_reduce: overlap | sharded``: the PARTIAL gradients reduced during backward (all-reduced,
or reduce-scattered with the optimizer state of their weights sharded over mp) give the serial
model in float64 on every plan, even and uneven splits, world 2 and 3, DP x mp (ZeRO-1 over dp),
pipelines with tied weights and recompute: the loss, every gradient (a sharded bucket's read back
from the pieces of every mp rank) and the clipped global norm on each of 3 steps, and every
parameter after the 3 AdamW steps. The harness is tests/test_dp_pp.py's."""

import dataclasses

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import GradRule, grad_rule
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.train.loop import Trainer, autocast_context, train
from galaxy.data.pretraining import mlm_data
from tests.core.test_dp_pp import BERT, LLAMA, RTOL, STEPS, TRAIN, build, llama_batch_at, rel_err

UNEVEN2 = dict(tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[15, 25], seq_scatter_list=[7, 5])
UNEVEN3 = dict(tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 5])
# name: (world, case); the BERT of test_dp_pp unless the case says llama.
CASES = {
    "tp-w3": (3, dict(plan="tp")),
    "sp-w2": (2, dict(plan="sp")),
    "galaxy-w2-uneven": (2, dict(plan="galaxy", **UNEVEN2)),
    "galaxy2-w3-uneven": (3, dict(plan="galaxy2", **UNEVEN3)),
    "dp2-galaxy2-zero1-m2": (4, dict(plan="galaxy2", dp_size=2, dp_engine="zero1", num_microbatches=2)),
    "dp2-sp-m2-recompute": (4, dict(plan="sp", dp_size=2, num_microbatches=2, recompute="full")),
    "llama-pp2-galaxy2-tied": (4, dict(model="llama", pp_size=2, plan="galaxy2", tie_word_embeddings=True,
                                       num_microbatches=2, recompute="selective")),
}
MODES = ("overlap", "sharded")


def full_grads(trainer: Trainer, model, ctx) -> dict[str, torch.Tensor]:
    """Every weight's full gradient; a ``sharded`` bucket's weights read from every mp rank's piece."""
    grads = {name: gather_full(p.grad, p, ctx.mp) for name, p in model.named_parameters() if p.grad is not None}
    names = {id(p): name for name, p in model.named_parameters()}
    for entry in trainer.grad_sync.shard_layout():
        piece = entry["stop"] - entry["start"]
        flat = ctx.mp.all_gather(entry["shard"].grad, 0, [piece] * ctx.mp.size)[:entry["numel"]]
        for p, g in zip(entry["params"], flat.split([p.numel() for p in entry["params"]])):
            assert names[id(p)] not in grads, "a sharded weight keeps no gradient of its own"
            grads[names[id(p)]] = g.view_as(p)
    return grads


def reduce_equals_serial(ctx, case, mode):
    cfg, serial_cfg, model, serial, batch_at = build(ctx, dict(case, mp_grad_reduce=mode))
    par = Trainer(model, cfg, ctx)
    ref = Trainer(serial, serial_cfg, ParallelContext.serial())
    partial = [p for p in model.parameters() if grad_rule(p) == GradRule.PARTIAL]
    if mode == "sharded":  # the optimizer holds pieces, not the PARTIAL weights (tied pipeline ones excepted)
        stepped = {id(p) for g in par.optimizer.param_groups for p in g["params"]}
        held = [p for p in partial if id(p) not in stepped]
        assert held and sum(s.numel() for s in par.grad_sync.shards()) * ctx.mp.size < \
            sum(p.numel() for p in held) + ctx.mp.size * len(par.grad_sync.shards())
    overlapped = []
    for step in range(STEPS):
        loss_t, loss_st = par.forward_backward(par.read_batch(batch_at, step)), ref.forward_backward(batch_at(step))
        assert abs(loss_t.item() - loss_st.item()) <= RTOL * abs(loss_st.item()), (step, loss_t, loss_st)
        grads, grads_s = full_grads(par, model, ctx), dict(serial.named_parameters())
        assert set(grads) == {n for n, _ in model.named_parameters() if grads_s[n].grad is not None}
        for name, g in grads.items():
            err = rel_err(g, grads_s[name].grad)
            assert err < RTOL, f"{mode} step {step}: grad of {name}: relative error {err:.2e}"
        overlapped.append(par.grad_sync.overlapped)
        norm, norm_s = par.optimizer_step(loss_t, step + 1).grad_norm, ref.optimizer_step(loss_st, step + 1).grad_norm
        assert abs(norm.item() - norm_s.item()) <= RTOL * norm_s.item(), (step, norm.item(), norm_s.item())
        assert norm_s.item() > cfg.train.grad_clip, "the test should exercise clipping"
    params_s = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        floor = 0.02 * params_s[name].numel() ** 0.5
        err = rel_err(gather_full(p.detach(), p, ctx.mp), params_s[name].detach(), floor)
        assert err < RTOL, f"{mode}: {name} after {STEPS} AdamW steps: relative error {err:.2e}"
    par.grad_sync.remove()
    return overlapped[-1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_partial_gradients_reduced_in_backward_equal_serial(dist_pool, name, mode):
    world, case = CASES[name]
    out = dist_pool.run(reduce_equals_serial, world, case, mode, dp=case.get("dp_size", 1),
                        pp=case.get("pp_size", 1))
    if case.get("plan") in ("sp", "galaxy2"):  # many PARTIAL buckets: some leave while backward runs
        assert all(overlapped > 0 for overlapped in out), out


def fp16_run(ctx, mode):
    """float16 with dynamic loss scaling from a scale that overflows (its steps are skipped alike on
    every rank), gradients reduced in float16: ``mode`` against ``after_backward`` on the same ranks."""
    losses, params = {}, {}
    for m in ("after_backward", mode):
        cfg = GalaxyConfig.from_dict(dict(BERT, **dict(TRAIN, dtype="float16")),
                                     dict(plan="galaxy2", grad_reduce_dtype="float16", initial_loss_scale=2.0 ** 40,
                                          max_steps=4, mp_grad_reduce=m))
        model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11)
        batch_at = mlm_data(cfg)[0]
        result = train(model, batch_at, cfg, ctx)
        losses[m] = result.losses, result.skipped_steps
        params[m] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params


@pytest.mark.parametrize("mode", MODES)
def test_fp16_loss_scaling_and_float16_reductions(dist_pool, mode):
    for losses, params in dist_pool.run(fp16_run, 2, mode):
        (ref, ref_skipped), (got, skipped) = losses["after_backward"], losses[mode]
        assert skipped == ref_skipped >= 1, "the first steps overflow and are skipped"
        # The same float16 sums in another order: equal to float16 rounding of the reduced gradients.
        assert got == pytest.approx(ref, rel=1e-3)
        for name, p in params[mode].items():
            assert rel_err(p, params["after_backward"][name], 0.02 * p.numel() ** 0.5) < 1e-3, name


def test_mp_grad_reduce_is_validated():
    with pytest.raises(ConfigError, match="mp_grad_reduce.*after_backward, overlap, sharded"):
        GalaxyConfig.from_dict({"mp_grad_reduce": "async"})


def overlap_without_second_group(ctx):
    cfg, _, model, _, _ = build(ctx, dict(plan="galaxy2", mp_grad_reduce="overlap"))
    with pytest.raises(ConfigError, match="mp_grad_reduce.*second process group"):
        Trainer(model, cfg, dataclasses.replace(ctx, mp_grad=None))
    return True


def test_overlap_needs_the_second_mp_group(dist_pool):
    assert all(dist_pool.run(overlap_without_second_group, 2))


def bf16_sharded_run(ctx, model_type):
    """bfloat16 autocast: ``sharded`` keeps the sharded weights in bfloat16 in the model, their fp32
    masters in the pieces; the loss curve follows ``after_backward``'s (fp32 weights) within bf16 noise."""
    curves = {}
    for mode in ("after_backward", "sharded"):
        raw = dict(LLAMA if model_type == "llama" else BERT, **dict(TRAIN, dtype="bfloat16"))
        cfg = GalaxyConfig.from_dict(raw, dict(plan="galaxy2", max_steps=3, mp_grad_reduce=mode))
        cls = LlamaForCausalLM if model_type == "llama" else BertForMaskedLM
        model = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11)
        batch_at = llama_batch_at if model_type == "llama" else mlm_data(cfg)[0]
        trainer = Trainer(model, cfg, ctx)
        if mode == "sharded":
            assert all(s.dtype == torch.float32 for s in trainer.grad_sync.shards())
            sharded = [p for e in trainer.grad_sync.shard_layout() for p in e["params"]]
            assert sharded and all(p.dtype == torch.bfloat16 for p in sharded)
        losses = []
        for step in range(cfg.train.max_steps):
            amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
            loss = trainer.forward_backward(trainer.read_batch(batch_at, step), amp)
            assert trainer.optimizer_step(loss, step + 1).skipped is None
            losses.append(loss.item())
        trainer.grad_sync.remove()
        curves[mode] = losses
    return curves


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_bf16_sharded_keeps_fp32_masters_in_the_pieces(dist_pool, model_type):
    for curves in dist_pool.run(bf16_sharded_run, 2, model_type):
        assert curves["sharded"][0] == pytest.approx(curves["after_backward"][0], rel=5e-3), curves
        assert curves["sharded"] == pytest.approx(curves["after_backward"], rel=2e-2), curves
