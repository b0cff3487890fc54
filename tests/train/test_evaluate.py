"""Evaluation on a held-out split: the same loss, accuracy and perplexity in every plan, pipeline
and dp layout as a direct computation on the serial model's logits; the CLI flag runs it."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch.nn.functional as F

from galaxy.config import GalaxyConfig
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.train.evaluate import evaluate
from galaxy.train.loop import Trainer
from galaxy.data.pretraining import mlm_data
from tests import REPO  # noqa: E402
from tests.in_process import run_script

ROOT = REPO
TRAIN = {"global_batch_size": 8, "seq_length": 12, "dtype": "float64", "eval_iters": 2}
MODELS = {
    "bert": {"preset": "bert-tiny", "vocab_size": 20, "hidden_size": 32, "num_attention_heads": 4,
             "intermediate_size": 64, "num_hidden_layers": 2},
    "llama": {"preset": "llama-tiny", "vocab_size": 20, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2},
}
CLASSES = {"bert": BertForMaskedLM, "llama": LlamaForCausalLM}


def eval_batches(cfg):
    return mlm_data(cfg, split="eval")[0]


def direct(model_type: str) -> dict:
    """Loss, accuracy (and perplexity) from the serial model's full logits, by hand."""
    cfg = GalaxyConfig.from_dict({"model": MODELS[model_type], "train": TRAIN})
    model = CLASSES[model_type](cfg.model, seed=3).double().eval()
    loss_sum = correct = targets = 0.0
    for i in range(cfg.train.eval_iters):
        batch = eval_batches(cfg)(i)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        labels = batch["labels"]
        if model_type == "llama":
            logits, labels = logits[:, :-1], labels[:, 1:]
        keep = labels != -100
        loss_sum += F.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
        correct += (logits.argmax(-1)[keep] == labels[keep]).sum().item()
        targets += keep.sum().item()
    out = {"eval_loss": loss_sum / targets, "eval_accuracy": correct / targets, "eval_targets": int(targets)}
    if model_type == "llama":
        out["eval_perplexity"] = math.exp(out["eval_loss"])
    return out


def evaluate_in_layout(ctx, model_type: str, overrides: dict) -> dict:
    cfg = GalaxyConfig.from_dict({"model": MODELS[model_type], "train": TRAIN}, overrides)
    ctx.stage_layers = cfg.stage_layers()
    model = CLASSES[model_type](cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3)
    trainer = Trainer(model, cfg, ctx)
    result = evaluate(trainer, eval_batches(cfg), cfg.train.eval_iters)
    trainer.grad_sync.remove()
    assert model.training, "evaluation puts the model back in training mode"
    return result


LAYOUTS = {
    "serial": (1, {"plan": "none"}),
    "galaxy2-uneven": (2, {"plan": "galaxy2", "seq_scatter_list": [7, 5]}),
    "tp-uneven": (2, {"plan": "tp", "tp_intermediate_size_list": [40, 24]}),
    "pp2-m2": (2, {"plan": "none", "pp_size": 2, "num_microbatches": 2}),
    "dp2-sp": (4, {"plan": "sp", "dp_size": 2}),
}


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_evaluation_equals_the_serial_logits_in_every_layout(dist_pool, model_type):
    expected = direct(model_type)
    assert 0 < expected["eval_accuracy"] < 1, "a small vocabulary gives a random model some hits to count"
    for layout, (world, overrides) in LAYOUTS.items():
        dp, pp = overrides.get("dp_size", 1), overrides.get("pp_size", 1)
        for got in dist_pool.run(evaluate_in_layout, world, model_type, overrides, dp=dp, pp=pp):
            assert got.keys() == expected.keys(), layout
            assert got["eval_targets"] == expected["eval_targets"], layout
            for key in expected:
                assert abs(got[key] - expected[key]) <= 1e-9 * abs(expected[key]), (layout, key, got, expected)


def test_eval_every_writes_eval_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [os.path.join(ROOT, "pretrain_galaxy.py"), "--world", "1", "--max_steps", "4",
           "--eval_every", "2", "--no_progress", "--metrics_file", str(metrics),
           "--override", "global_batch_size=4", "--override", "seq_length=16", "--override", "eval_iters=1"]
    proc = run_script(cmd, cwd=tmp_path, timeout=300)  # in this process (tests.in_process)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evaluated = [r["step"] for r in rows if "eval_loss" in r]
    assert evaluated == [2, 4]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_targets"] > 0 for r in rows if "eval_loss" in r)


def write_sentiment(path, n: int, seed: int = 0) -> None:
    """Labelled lines whose class is given by one mood word among filler words."""
    import random

    r = random.Random(seed)
    filler = "the a movie film plot actor scene story was is very quite really".split()
    moods = (["awful", "boring", "terrible"], ["great", "wonderful", "superb"])
    with open(path, "w") as f:
        for _ in range(n):
            label = r.randint(0, 1)
            words = [r.choice(filler) for _ in range(r.randint(3, 8))] + [r.choice(moods[label])]
            f.write(json.dumps({"text": " ".join(words + [r.choice(filler) for _ in range(3)]), "label": label}) + "\n")


def test_sequence_classification_trains_and_reports_accuracy(tmp_path):
    write_sentiment(tmp_path / "train.jsonl", 300)
    write_sentiment(tmp_path / "dev.jsonl", 64, seed=1)
    summary = tmp_path / "summary.json"
    cmd = [os.path.join(ROOT, "pretrain_galaxy.py"), "--world", "2", "--max_steps", "40",
           "--data", "train.jsonl", "--eval_every", "40", "--no_progress", "--summary_json", str(summary),
           "--override", "task=classify", "--override", "eval_data=dev.jsonl", "--override", "seq_length=32",
           "--override", "global_batch_size=16", "--override", "eval_iters=4", "--override", "vocab_size=200",
           "--save_dir", "ck"]
    # in this process (tests.in_process); the ranks are processes of their own
    proc = run_script(cmd, cwd=tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(summary.read_text())
    assert result["eval_targets"] == 64, "4 held-out batches of 16 examples"
    assert result["eval_accuracy"] >= 0.9, result
    assert result["final_loss"] < result["first_loss"] / 4
    # The WordPiece was trained once for the run (one cached file), saved beside its checkpoints, and
    # goes with the HF export, where transformers reads the same vocabulary.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from galaxy.train.checkpoint import export_hf, latest_valid_checkpoint

    cached = list((tmp_path / "cache" / "galaxy" / "tokenizers").glob("*/tokenizer.json"))
    assert len(cached) == 1
    vocab = Tokenizer.from_file(str(cached[0])).get_vocab()
    assert Tokenizer.from_file(str(tmp_path / "ck" / "tokenizer" / "tokenizer.json")).get_vocab() == vocab
    out = export_hf(latest_valid_checkpoint(str(tmp_path / "ck")), str(tmp_path / "hf"))
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).get_vocab() == vocab


def test_bad_labelled_data_is_one_clear_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine", "label": 0}\n{"text": "oops", "label": "yes"}\n')
    cmd = [os.path.join(ROOT, "pretrain_galaxy.py"), "--world", "1", "--max_steps", "1",
           "--data", "bad.jsonl", "--no_progress", "--override", "task=classify"]
    proc = run_script(cmd, cwd=tmp_path, timeout=300)  # in this process (tests.in_process)
    assert proc.returncode != 0
    assert 'bad.jsonl:2: "label" must be a non-negative integer class id' in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
