"""A save that cannot be written (a read-only file system here; a full disk in tests/cli/test_run_faults.py)
fails in one line naming the directory and the bytes a checkpoint needs, leaves no temporary directory
and keeps the checkpoint before it."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from galaxy.core.context import ParallelContext
from galaxy.train.checkpoint import CheckpointError, latest_valid_checkpoint
from galaxy.train.loop import train
from galaxy.train.options import Checkpointing
from tests.train.checkpoint.helpers import build


@contextlib.contextmanager
def mounted_tmpfs(mount, size: str):
    """A tmpfs of ``size`` (mount(8)'s, e.g. "1m") at the new folder ``mount``, unmounted whatever happens;
    the test is skipped, saying why, where mounting is not permitted."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and mount(8) needed): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "16m") as mount:
        yield mount


def test_a_save_on_a_file_system_made_read_only_fails_in_one_line(small_tmpfs):
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=2))
    train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(small_tmpfs)))
    kept = small_tmpfs / "step_000002"
    size = sum(f.stat().st_size for f in kept.iterdir())
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=3))
    with pytest.raises(CheckpointError) as failed:
        train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(small_tmpfs), resume=str(kept)))
    tmp = failed.value.args[0].split("writing '")[1].split("'")[0]
    assert str(failed.value) == (
        f"saving checkpoint '{small_tmpfs / 'step_000003'}' failed: read-only file system (rank 0 writing '{tmp}'); "
        f"a checkpoint needs about {size} bytes (the last one's size); the last good checkpoint '{kept}' is kept")
    assert tmp.startswith(str(small_tmpfs / "step_000003.tmp-"))
    assert os.listdir(small_tmpfs) == ["step_000002"]
    assert latest_valid_checkpoint(str(small_tmpfs)) == str(kept)
