"""``pretrain_galaxy.py`` (``galaxy.cli.pretrain``) shows a run's speed: tokens/s per GPU and MFU in the
metrics file, the summary, the progress bar and TensorBoard event files; a missing tensorboard package is
one line before any rank starts."""

import json
import os
import sys

import pytest

from galaxy.cli.pretrain import main
from galaxy.train.metrics import TENSORBOARD_MISSING
from tests.in_process import run_script


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_reports_per_gpu_rates_and_mfu_and_writes_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics, summary, board = tmp_path / "m.jsonl", tmp_path / "s.json", tmp_path / "tb"
    # in this process (tests.in_process); the ranks are processes of their own
    out = run_script(["pretrain_galaxy.py", "--world", "2", "--max_steps", "3", "--override", "log_every=1",
                      "--peak_tflops", "0.5", "--metrics_file", str(metrics), "--summary_json", str(summary),
                      "--tensorboard", str(board)], cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["tokens_per_s_per_gpu"] * 2 == pytest.approx(r["tokens_per_s"], rel=1e-12)
        assert 0 < r["mfu"] < 1
    fields = json.loads(summary.read_text())
    assert fields["tokens_per_s_per_gpu"] * 2 == pytest.approx(fields["tokens_per_s"], abs=0.2)  # rounded to 0.1
    assert fields["peak_tflops"] == 0.5 and 0 < fields["mfu"] < 1
    assert "tok_s_gpu=" in out.stderr and "mfu=" in out.stderr  # the progress bar
    assert "tokens_per_s_per_gpu" in out.stdout and "mfu" in out.stdout  # the printed summary

    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "throughput/tokens_per_s", "throughput/tokens_per_s_per_gpu",
            "throughput/mfu", "memory/peak_mem_mb"} <= tags
    for tag, key in (("train/loss", "loss"), ("throughput/mfu", "mfu"), ("memory/peak_mem_mb", "peak_mem_mb")):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_missing_tensorboard_is_one_line_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    board = tmp_path / "tb"
    assert main(["--world", "2", "--max_steps", "2", "--tensorboard", str(board)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {TENSORBOARD_MISSING}" and "pip install tensorboard" in err
    assert not board.exists()
