"""``train`` with ``Interrupts``: SIGINT or SIGTERM during a step stops every rank after that step, the
checkpoint schedule saves it, and the run resumed from it repeats the uninterrupted one bit for bit
(float64); a second SIGINT stops at once; a rank whose launcher is gone writes nothing. The harness is
tests/train/checkpoint/helpers.py's (a tiny float64 BERT)."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch

from galaxy.core.context import ParallelContext
from galaxy.train.interrupts import Interrupts, LauncherGone, TrainingInterrupted
from galaxy.train.loop import train
from galaxy.train.options import Checkpointing
from tests.train.checkpoint.helpers import build

STEPS = 6


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def signal_self_at(step: int, signals=(signal.SIGINT,), rank: int = 0, ctx=None):
    """An ``on_step`` that sends this process ``signals`` inside step ``step`` (on ``rank`` only)."""
    def on_step(done: int, loss: float) -> None:
        if done == step and (ctx is None or ctx.rank == rank):
            for signum in signals:
                os.kill(os.getpid(), signum)
    return on_step


def interrupt_then_resume(ctx, case, directory, stop_at, signum):
    """The uninterrupted run; the run that one rank's signal stops in step ``stop_at``; the run resumed from
    its checkpoint. Returns (where it stopped, the checkpoint) and asserts the resumed run is the uninterrupted."""
    cfg, _, model, _, batch_at = build(ctx, case)
    expected = train(model, batch_at, cfg, ctx).losses
    expected_params = params(model)

    cfg, _, model, _, batch_at = build(ctx, case)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(TrainingInterrupted) as stopped:
        train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=directory), interrupts=Interrupts(),
              on_step=signal_self_at(stop_at, (signum,), rank=ctx.world_size - 1, ctx=ctx))
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "train restores the handlers it replaced"
    assert sorted(os.listdir(directory)) == [f"step_{stop_at:06d}"]

    cfg, _, model, _, batch_at = build(ctx, case)
    resumed = train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(resume=directory)).losses
    assert resumed == expected[stop_at:], f"resumed losses {resumed} != uninterrupted {expected[stop_at:]}"
    got = params(model)
    differ = [k for k in expected_params if not torch.equal(expected_params[k], got[k])]
    assert not differ, f"parameters differ after resuming: {differ[:3]}"
    return stopped.value.step, stopped.value.checkpoint


def test_a_signal_stops_after_its_step_which_is_saved_and_resumed_exactly(tmp_path):
    step, checkpoint = interrupt_then_resume(ParallelContext.serial(), dict(plan="none", max_steps=STEPS),
                                             str(tmp_path), 3, signal.SIGINT)
    assert (step, checkpoint) == (3, str(tmp_path / "step_000003"))


def interrupt_agreed_on_the_host(ctx, *args):
    """``interrupt_then_resume`` with the ranks agreeing over a host group (``initialize`` makes one over Gloo
    beside a GPU world's NCCL, every rank of the world; here the task's two ranks, its mp group) instead of the
    mp, pp and dp groups."""
    return interrupt_then_resume(dataclasses.replace(ctx, host_group=ctx.mp.group), *args)


@pytest.mark.parametrize("agree", [interrupt_then_resume, interrupt_agreed_on_the_host], ids=["groups", "host"])
def test_every_rank_stops_after_the_step_one_rank_was_signalled_in(dist_pool, tmp_path, agree):
    """Only the last rank gets SIGTERM: both agree on its step, save it together and resume exactly."""
    stopped = dist_pool.run(agree, 2, dict(plan="galaxy", max_steps=STEPS), str(tmp_path), 2, signal.SIGTERM)
    assert stopped == [(2, str(tmp_path / "step_000002"))] * 2


def test_without_a_save_directory_the_interrupt_says_why_nothing_was_saved():
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=STEPS))
    with pytest.raises(TrainingInterrupted) as stopped:
        train(model, batch_at, cfg, ctx, interrupts=Interrupts(), on_step=signal_self_at(2))
    assert (stopped.value.step, stopped.value.checkpoint, stopped.value.why_not) == (2, None, "no save directory")


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=STEPS))
    with pytest.raises(KeyboardInterrupt) as stopped:
        train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path)), interrupts=Interrupts(),
              on_step=signal_self_at(2, (signal.SIGINT, signal.SIGINT)))
    assert not isinstance(stopped.value, TrainingInterrupted)
    assert os.listdir(tmp_path) == [], "no checkpoint: it stopped inside the step"


def test_a_rank_whose_launcher_is_gone_writes_no_checkpoint(tmp_path):
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=STEPS))
    not_the_parent = os.getpid()  # this process's launcher, as a rank whose launcher died sees it: not its parent
    steps = []
    with pytest.raises(LauncherGone, match=f"the launcher \\(pid {not_the_parent}\\) that started this rank is gone"):
        train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path), save_every=2),
              interrupts=Interrupts(launcher_pid=not_the_parent), on_step=lambda step, loss: steps.append(step))
    assert steps == [1, 2] and os.listdir(tmp_path) == []
