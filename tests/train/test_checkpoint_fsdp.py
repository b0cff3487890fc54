"""Checkpoints of FSDP runs (``dp_engine: fsdp2``, ``mp_grad_reduce: fsdp``): their DTensor weights and
AdamW states are saved as regions of the full parameters (the TP shard's offsets plus FSDP's block),
so a run resumed under the same layout repeats the uninterrupted run bit for bit, and a checkpoint
moves between FSDP and the other engines, dp x mp layouts and plans with weights, moments and step
counts equal to the serial model trained as many steps (float64, 1e-9), the next steps giving the
serial model's losses. The harness is tests/train/checkpoint/helpers.py's."""

from __future__ import annotations

import pytest

from galaxy.core.fsdp import fsdp_axes, is_dtensor
from galaxy.train.checkpoint import load_checkpoint
from galaxy.train.loop import Trainer
from tests.core.test_dp_pp import rel_err
from tests.core.test_fsdp import full
from tests.train.checkpoint.helpers import (SAVED_AT, STEPS, TOL, build, run_steps, saved_runs, serial_reference,
                                            sharded_resume_is_exact)

FSDP_DP2_GALAXY2 = dict(plan="galaxy2", dp_size=2, dp_engine="fsdp2", mp_grad_reduce="fsdp")
UNEVEN3 = dict(plan="galaxy2", tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 5])


def test_fsdp_run_resumes_bit_identically(dist_pool, tmp_path):
    """5 steps of ``train`` with fsdp2 over dp 2 and the galaxy2 MLPs sharded over dp x mp, saving after
    step 3; steps 4-5 resumed from it repeat the run's losses and its final checkpoint bit for bit."""
    case = dict(FSDP_DP2_GALAXY2, max_steps=STEPS)
    dtypes = dist_pool.run(sharded_resume_is_exact, 4, case, str(tmp_path), dp=2)[0]
    assert set(dtypes.values()) == {"torch.float64"}, dtypes


def resume_fsdp_elsewhere(ctx, case, directory):
    """Load into ``case``'s layout; every full weight and AdamW state (FSDP and TP shards gathered) equals
    the serial model's after the same steps, and the next steps give its losses."""
    weights, state, later = serial_reference(ctx, case)
    cfg, _, model, _, batch_at = build(ctx, dict(case, max_steps=STEPS))
    trainer = Trainer(model, cfg, ctx)
    assert load_checkpoint(directory, model, trainer.optimizer, trainer.schedule, ctx, cfg,
                           grad_reducer=trainer.grad_sync).step == SAVED_AT
    for name, p in model.named_parameters():
        err = rel_err(full(p.detach(), p, ctx), weights[name], 0.02 * p.numel() ** 0.5)
        assert err < TOL, f"weight {name}: relative error {err:.2e}"
        got = trainer.optimizer.state[p]
        assert got["step"].item() == SAVED_AT and is_dtensor(got["exp_avg"]) == is_dtensor(p), name
        for key, floor in (("exp_avg", 1e-6), ("exp_avg_sq", 1e-10)):
            err = rel_err(full(got[key], p, ctx), state[name][key], floor * p.numel() ** 0.5)
            assert err < TOL, f"{name} {key}: relative error {err:.2e}"
    losses = run_steps(trainer, batch_at, SAVED_AT, STEPS)
    trainer.grad_sync.remove()
    for got, want in zip(losses, later):
        assert abs(got - want) <= TOL * abs(want), (losses, later)
    return sorted({"x".join(fsdp_axes(p)) for p in model.parameters()})


SAVED = {"fsdp2-dp2-galaxy2-mpfsdp": (4, 2, FSDP_DP2_GALAXY2),
         "after_backward-galaxy2-w2": (2, 1, dict(plan="galaxy2"))}


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory):
    """Checkpoints after 3 steps of each run in ``SAVED``."""
    return saved_runs(SAVED, dist_pool, tmp_path_factory)


@pytest.mark.parametrize("source,world,dp,case,axes", [
    ("fsdp2-dp2-galaxy2-mpfsdp", 3, 1, UNEVEN3, [""]),                                 # -> ddp, world 3 uneven
    ("fsdp2-dp2-galaxy2-mpfsdp", 2, 2, dict(plan="none", dp_size=2, dp_engine="fsdp2"), ["", "dp"]),  # dp2 x mp1
    ("after_backward-galaxy2-w2", 4, 2, dict(plan="tp", dp_size=2, dp_engine="fsdp2"), ["", "dp"]),   # dp2 x tp2
    ("after_backward-galaxy2-w2", 3, 1, dict(UNEVEN3, mp_grad_reduce="fsdp"), ["", "mp"]),      # -> mp3 sharded
])
def test_fsdp_checkpoint_moves_between_engines_layouts_and_plans(dist_pool, saved, source, world, dp, case, axes):
    out = dist_pool.run(resume_fsdp_elsewhere, world, case, saved(source), dp=dp)
    assert all(got == axes for got in out), out
