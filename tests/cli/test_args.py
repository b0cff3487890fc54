"""The CLIs' shared arguments (``galaxy.cli.args``): a bare ``--resume`` hands the save directory to the load."""

from __future__ import annotations

from galaxy.core.context import ParallelContext
from galaxy.train.checkpoint import load_checkpoint
from galaxy.train.loop import Trainer, train
from galaxy.train.options import Checkpointing
from tests.train.checkpoint.helpers import build


def test_bare_resume_hands_the_save_directory_to_the_load(tmp_path):
    """``--resume`` without a path: nothing to resume from an empty directory or an interrupted save;
    otherwise the save directory itself, whose newest valid checkpoint the collective load picks."""
    import argparse

    from galaxy.cli.args import resume_path

    args = argparse.Namespace(resume="latest", save_dir=str(tmp_path))
    assert resume_path(args) is None
    (tmp_path / "step_000002").mkdir()  # an interrupted save: no manifest
    assert resume_path(args) is None
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=1))
    train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path)))
    assert resume_path(args) == str(tmp_path)
    cfg, _, model, _, _ = build(ctx, dict(plan="none", max_steps=1))
    trainer = Trainer(model, cfg, ctx)
    assert load_checkpoint(resume_path(args), model, trainer.optimizer, trainer.schedule, ctx).step == 1
