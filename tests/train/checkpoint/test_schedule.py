"""When a run saves (``galaxy.train.checkpoint.schedule.CheckpointSchedule``): after every N-th step and the
last, keeping the newest K; an interrupt saves the step the run stopped at unless that step is saved
already. The saved checkpoints load back to the trainer's weights."""

import os
import re

import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models import build_model
from galaxy.train.checkpoint import load_checkpoint
from galaxy.train.checkpoint.schedule import CheckpointSchedule
from galaxy.train.loop import Trainer

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
