"""FSDP2 under the plans: ``dp_engine: fsdp2`` (torch's ``fully_shard`` over dp) and ``mp_grad_reduce:
fsdp`` (the replicated weights of SP blocks sharded over mp, over dp x mp with fsdp2) give the serial
model in float64: the loss, every gradient (DTensor shards gathered) and the clipped global norm on
each of 3 steps, and every parameter after the 3 AdamW steps; the sharded mode holds 1/mp of those
weights' parameters, gradients and optimizer state per rank; the config refuses what it cannot do.
The harness (tiny BERT / LLaMA, float64) is tests/core/test_dp_pp.py's."""

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.fsdp import fsdp_axes, is_dtensor, local
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import GradRule, grad_rule
from galaxy.train.loop import Trainer
from tests.core.test_dp_pp import RTOL, STEPS, build, rel_err

UNEVEN2 = dict(tp_num_attention_heads_list=[6, 2], tp_intermediate_size_list=[15, 25], seq_scatter_list=[7, 5])
UNEVEN3 = dict(tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 5])
FSDP2 = dict(dp_engine="fsdp2")
# name: (world, case); the BERT of test_dp_pp unless the case says llama.
CASES = {
    "dp2-mp1": (2, dict(FSDP2, plan="tp", dp_size=2, num_microbatches=2)),
    "dp2-tp2": (4, dict(FSDP2, plan="tp", dp_size=2)),
    "dp2-galaxy2-llama": (4, dict(FSDP2, model="llama", plan="galaxy", dp_size=2)),
    "dp2-galaxy2": (4, dict(FSDP2, plan="galaxy2", dp_size=2, num_microbatches=2)),
    "dp2-galaxy2-mpfsdp": (4, dict(FSDP2, plan="galaxy2", dp_size=2, mp_grad_reduce="fsdp")),
    "galaxy2-mpfsdp-w2-uneven-llama": (2, dict(model="llama", plan="galaxy2", mp_grad_reduce="fsdp", **UNEVEN2)),
    "galaxy2-mpfsdp-w3-uneven": (3, dict(plan="galaxy2", mp_grad_reduce="fsdp", **UNEVEN3)),
    "ddp-dp2-sp-mpfsdp": (4, dict(plan="sp", dp_size=2, mp_grad_reduce="fsdp", reshard_after_forward="never")),
    "dp2-pp2-llama-tied": (4, dict(FSDP2, model="llama", plan="none", dp_size=2, pp_size=2,
                                   tie_word_embeddings=True, num_microbatches=2)),
}


def full(t: torch.Tensor, p: torch.Tensor, ctx) -> torch.Tensor:
    """The full tensor of parameter ``p`` (or its gradient ``t``): FSDP shards gathered, then TP shards."""
    if is_dtensor(t):
        t = t.full_tensor()
    return gather_full(t, p, ctx.mp)


def fsdp_equals_serial(ctx, case):
    cfg, serial_cfg, model, serial, batch_at = build(ctx, case)
    par = Trainer(model, cfg, ctx)
    ref = Trainer(serial, serial_cfg, ParallelContext.serial())
    axes = {"x".join(fsdp_axes(p)) for p in model.parameters()}
    params_s = dict(serial.named_parameters())
    for step in range(STEPS):
        loss_t, loss_st = par.forward_backward(par.read_batch(batch_at, step)), ref.forward_backward(batch_at(step))
        assert abs(loss_t.item() - loss_st.item()) <= RTOL * abs(loss_st.item()), (step, loss_t, loss_st)
        for name, p in model.named_parameters():
            assert (p.grad is None) == (params_s[name].grad is None), name
            if p.grad is not None:
                err = rel_err(full(p.grad, p, ctx), params_s[name].grad)
                assert err < RTOL, f"step {step}: grad of {name}: relative error {err:.2e}"
        norm, norm_s = par.optimizer_step(loss_t, step + 1).grad_norm, ref.optimizer_step(loss_st, step + 1).grad_norm
        assert abs(norm.item() - norm_s.item()) <= RTOL * norm_s.item(), (step, norm.item(), norm_s.item())
        assert norm_s.item() > cfg.train.grad_clip, "the test should exercise clipping"
    for name, p in model.named_parameters():
        floor = 0.02 * params_s[name].numel() ** 0.5
        err = rel_err(full(p.detach(), p, ctx), params_s[name].detach(), floor)
        assert err < RTOL, f"{name} after {STEPS} AdamW steps: relative error {err:.2e}"
    par.grad_sync.remove()
    return sorted(axes)


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_equals_serial(dist_pool, name):
    world, case = CASES[name]
    out = dist_pool.run(fsdp_equals_serial, world, case, dp=case.get("dp_size", 1), pp=case.get("pp_size", 1))
    dp, mp_fsdp = case.get("dp_engine") == "fsdp2", case.get("mp_grad_reduce") == "fsdp"
    mp = world // (case.get("dp_size", 1) * case.get("pp_size", 1))
    expected = {"dp"} if dp else {""}  # fsdp2 shards every weight over dp at least
    if mp_fsdp and mp > 1:
        expected.add("dpxmp" if dp else "mp")
    assert all(set(axes) == expected for axes in out), (out, expected)
