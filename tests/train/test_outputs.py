"""Where a run's step records go (``galaxy.train.outputs.StepOutputs``): rank 0 appends each record to the
metrics file as one JSON line, after what an earlier run wrote; other ranks write nothing."""

import json

from galaxy.train.outputs import StepOutputs


def record(step):
    return {"step": step, "loss": 2.5 / step, "lr": 1e-3, "tokens_per_s": 100.0 * step,
            "tokens_per_s_per_gpu": 50.0 * step, "mfu": None if step == 1 else 0.25}


def test_rank_zero_appends_json_lines_and_other_ranks_write_nothing(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0}) + "\n")  # an earlier run's line stays
    for is_main in (False, True):
        outputs = StepOutputs(is_main, start_step=0, max_steps=3, log_every=2, progress=is_main,
                              metrics_file=str(metrics))
        for step in (1, 2, 3):
            outputs.write(record(step))
        outputs.close()
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == [{"step": 0}] + [record(s) for s in (1, 2, 3)]
    StepOutputs(False, 0, 1, 1, metrics_file=str(tmp_path / "other.jsonl")).close()
    assert not (tmp_path / "other.jsonl").exists()
