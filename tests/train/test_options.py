"""``galaxy.train.options``: what a run asks of ``train``, checked when made (one ConfigError line naming the
key), and the CLI's ``RunOptions`` turned into them."""

from __future__ import annotations

import pytest

from galaxy.cli.args import RESUME_LATEST, RunOptions
from galaxy.config import ConfigError
from galaxy.train.options import Checkpointing, Reporting


@pytest.mark.parametrize("kwargs, key", [(dict(peak_tflops=0.0), "peak_tflops"), (dict(profile_step=0), "profile_step"),
                                         (dict(profile_json="p.json"), "profile_json needs profile_step"),
                                         (dict(untimed_steps=-1), "untimed_steps")])
def test_bad_reporting_names_its_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        Reporting(**kwargs)


@pytest.mark.parametrize("kwargs, key", [(dict(save_dir="d", save_every=-1), "save_every"),
                                         (dict(save_dir="d", keep_last=0), "keep_last"),
                                         (dict(save_every=2), "need a save_dir"),
                                         (dict(keep_last=1), "need a save_dir")])
def test_bad_checkpointing_names_its_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        Checkpointing(**kwargs)


def test_the_default_reports_and_saves_nothing():
    assert Reporting() == Reporting(progress=False, metrics_file=None, tensorboard_dir=None, peak_tflops=None,
                                    profile_step=None, profile_json=None)
    assert Checkpointing() == Checkpointing(save_dir=None, save_every=0, keep_last=None, resume=None)


def test_run_options_give_the_loops_options_and_refuse_what_they_refuse():
    options = RunOptions(no_progress=True, metrics_file="m.jsonl", tensorboard="tb", peak_tflops=2.0, profile_step=3,
                         profile_json="p.json", save_dir="d", save_every=5, keep_last=2, resume=RESUME_LATEST)
    assert options.reporting() == Reporting(progress=False, metrics_file="m.jsonl", tensorboard_dir="tb",
                                            peak_tflops=2.0, profile_step=3, profile_json="p.json")
    assert options.checkpointing("d") == Checkpointing(save_dir="d", save_every=5, keep_last=2, resume="d")
    assert RunOptions().reporting().progress
    with pytest.raises(ConfigError, match="keep_last"):
        RunOptions(save_dir="d", keep_last=0)
    with pytest.raises(ConfigError, match="--resume without a PATH"):
        RunOptions(resume=RESUME_LATEST)
