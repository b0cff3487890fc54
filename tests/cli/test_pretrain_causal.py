"""``pretrain_galaxy.py`` on causal LMs: packed windows on any plan, dp and pp, the same first loss as serial."""

import json
import os

import pytest

from galaxy.cli.pretrain import main
from tests import REPO
from tests.in_process import run_script

CONFIG = "train_config/llama/pretrain.json"
STEPS = 6


def serial_first_loss(overrides: dict) -> float:
    """The serial model's loss on step 0's global batch, in float64, built here in one process."""
    import torch

    from galaxy.config import GalaxyConfig
    from galaxy.core.context import ParallelContext
    from galaxy.data.pretraining import causal_lm_data
    from galaxy.models import build_model

    cfg = GalaxyConfig.from_file(os.path.join(REPO, CONFIG), overrides)
    batch_at, _, _ = causal_lm_data(cfg)
    model = build_model(cfg, None, ParallelContext.serial(seed=cfg.train.seed)).double()
    with torch.no_grad():
        return float(model(**batch_at(0)).loss)


@pytest.mark.parametrize("name,world,overrides", [
    ("galaxy", 2, {}),
    ("dp2", 2, {"plan": "none", "dp_size": 2}),
    ("pp2 qwen2", 2, {"plan": "none", "pp_size": 2, "num_microbatches": 2, "model_type": "qwen2"}),
])
def test_causal_pretraining_matches_serial_first_loss_and_learns(tmp_path, name, world, overrides):
    overrides = {"dtype": "float64", "max_steps": STEPS, "global_batch_size": 4, "seq_length": 32,
                 "warmup_steps": 0, **overrides}
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "s.json"
    argv = ["pretrain_galaxy.py", "--config", CONFIG, "--world", str(world),
            "--no_progress", "--metrics_file", str(metrics), "--summary_json", str(summary)]
    for key, value in overrides.items():
        argv += ["--override", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    out = run_script(argv, timeout=300)  # in this process (tests.in_process); the ranks are processes
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses
    assert abs(losses[0] - serial_first_loss(overrides)) < 1e-9, name
    fields = json.loads(summary.read_text())
    if "dp_size" in overrides or "pp_size" in overrides:
        assert fields["dp x pp x mp"] == ("2 x 1 x 1" if "dp_size" in overrides else "1 x 2 x 1")


def test_bert_named_scripts_refuse_causal_lms(capsys):
    assert main(["--config", CONFIG], plan="none", strict=False, fill="dp", masked_only=True) == 2
    err = capsys.readouterr().err.strip()
    assert "pretrains masked LMs" in err and "pretrain_galaxy.py" in err and len(err.splitlines()) == 1


def test_a_causal_lm_has_no_classification_task(capsys):
    assert main(["--config", CONFIG, "--override", "task=classify"]) == 2
    err = capsys.readouterr().err.strip()
    assert "config key 'task'" in err and len(err.splitlines()) == 1
