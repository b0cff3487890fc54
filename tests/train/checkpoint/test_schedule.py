"""When a run saves (``galaxy.train.checkpoint.schedule.CheckpointSchedule``): after every N-th step and the
last, keeping the newest K; an interrupt saves the step the run stopped at unless that step is saved
already. The saved checkpoints load back to the trainer's weights. Asynchronous saves (``checkpoint_async_mode:
async``) in ``train``: each is written while the next steps run, and a failed write stops the run in one line."""

import os
import re

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models import build_model
from galaxy.train.checkpoint import CheckpointError, load_checkpoint
from galaxy.train.checkpoint import files as ckpt_files
from galaxy.train.checkpoint.schedule import CheckpointSchedule
from galaxy.train.loop import Trainer, train
from galaxy.train.options import Checkpointing
from tests.train.checkpoint.helpers import build

BERT = {"preset": "bert-tiny", "vocab_size": 40, "max_position_embeddings": 16, "seq_length": 8,
        "num_hidden_layers": 1}


def saved_steps(directory):
    """Steps of the complete checkpoints (``step_N/``; a write in flight is ``step_N.tmp-*``)."""
    return sorted(int(m.group(1)) for m in map(re.compile(r"step_(\d+)").fullmatch, os.listdir(directory)) if m)


def test_saves_every_nth_and_the_last_keeping_the_newest_and_on_interrupt(tmp_path):
    cfg = GalaxyConfig.from_dict(BERT)
    ctx = ParallelContext.serial()
    trainer = Trainer(build_model(cfg, None, ctx, "lm"), cfg, ctx)
    schedule = CheckpointSchedule(str(tmp_path), every=3, keep_last=2, last=7)
    assert [s for s in range(1, 8) if schedule.due(s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if CheckpointSchedule(str(tmp_path), 0, None, 7).due(s)] == [7]
    for step in range(1, 5):
        schedule.after_step(step, trainer)
    assert saved_steps(tmp_path) == [3]
    path = schedule.on_interrupt(4, trainer)  # stopped after step 4: saved now
    assert saved_steps(tmp_path) == [3, 4] and schedule.on_interrupt(4, trainer) == path  # not saved twice
    for step in range(5, 8):
        schedule.after_step(step, trainer)
    assert saved_steps(tmp_path) == [6, 7]
    fresh = build_model(cfg, None, ctx, "lm")
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    assert load_checkpoint(str(tmp_path), fresh, None, None, ctx).step == 7  # the newest
    for (name, want), got in zip(trainer.model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), name


def test_async_saves_overlap_the_next_steps_and_resume_exactly(tmp_path):
    """``checkpoint_async_mode: async``: the save after step 1 is still being written while step 2 runs
    (its write is held until step 2 has ended: a synchronous save would wait forever); the save after
    step 2 and the end of training wait for the pending ones, so all are complete when ``train``
    returns, and resuming from the first repeats the run."""
    import threading

    from galaxy.train.checkpoint import shards

    ctx = ParallelContext.serial()
    case = dict(plan="none", max_steps=3, checkpoint_async_mode="async")
    cfg, _, model, _, batch_at = build(ctx, case)
    step_two, write = threading.Event(), shards._RankWriter.write_data

    def after_step_two(self, plan, planner):
        assert step_two.wait(60), "the save held training up"
        return write(self, plan, planner)

    shards._RankWriter.write_data = after_step_two  # test-only
    try:
        whole = train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path), save_every=1),
                      on_step=lambda step, loss: step == 2 and step_two.set()).losses
    finally:
        shards._RankWriter.write_data = write
    assert sorted(os.listdir(tmp_path)) == ["step_000001", "step_000002", "step_000003"]
    assert all(ckpt_files.verify_checkpoint(str(tmp_path / d)) for d in os.listdir(tmp_path))
    cfg, _, model, _, batch_at = build(ctx, case)
    resumed = train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(resume=str(tmp_path / "step_000001"))).losses
    assert resumed == whole[1:]


def test_async_save_failure_stops_training_with_one_line(tmp_path):
    """The save directory is a file: the failed write surfaces when the next save waits for it."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=3, checkpoint_async_mode="async"))
    steps = []
    with pytest.raises(CheckpointError, match=r"saving checkpoint '.*step_000001' failed on rank 0: ") as raised:
        train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(not_a_dir), save_every=1),
              on_step=lambda step, loss: steps.append(step))
    assert "\n" not in str(raised.value)
    assert steps == [1, 2], "training went on while the first save was pending; the second save waited for it"
