"""``--model_path`` on every command reads the checkpoint's own config.json (family and sizes, through the
model registry): a Qwen2 that ``transformers`` saved pretrains on two ranks on the galaxy plan from its own
weights, infers and profiles as ``transformers`` does; a config whose model section disagrees, or a
checkpoint that is not there, is one line and exit code 2, before any rank starts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from galaxy.cli import compare, infer, pretrain, profile
from tests import REPO
from tests.in_process import run_script

CONFIG = os.path.join(REPO, "train_config", "llama", "pretrain.json")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 made and saved by transformers (q/k/v biases, GQA), and its directory."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=600, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config)
    directory = tmp_path_factory.mktemp("qwen2") / "hf"
    model.save_pretrained(str(directory))
    return model.double().eval(), str(directory)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_pretrain_at_world_2_on_the_galaxy_plan_starts_from_the_checkpoint(qwen2, tmp_path):
    """The first step's loss is the next-token loss of transformers' model of the saved weights on that batch, in
    float64 (transformers' own loss function casts the logits to float32), to 1e-8: transformers makes its RoPE
    tables in float32 whatever the dtype (1e-9 here; a float32 run of the CLI is 3e-7 off)."""
    from galaxy.cli.args import build_config
    from galaxy.data.pretraining import causal_lm_data

    hf, path = qwen2
    overrides = {"dtype": "float64", "global_batch_size": 4, "seq_length": 32, "max_steps": 2, "model_path": path}
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "s.json"
    argv = ["pretrain_galaxy.py", "--world", "2", "--no_progress", "--metrics_file", str(metrics), "--summary_json",
            str(summary)]
    for key, value in overrides.items():
        argv += ["--override", f"{key}={value}"]
    out = run_script(argv, timeout=300)  # in this process (tests.in_process); the ranks are processes
    assert out.returncode == 0, out.stderr[-3000:]
    fields = json.loads(summary.read_text())
    assert fields["plan"] == "galaxy" and fields["world"] == 2 and fields["att/con/mlp"] == "TP/SP/TP"
    cfg = build_config(None, pretrain.DEFAULT_BERT, overrides)
    assert cfg.model.model_type == "qwen2" and cfg.model.qkv_bias and cfg.model.kv_heads == 2
    batch = causal_lm_data(cfg)[0](0)
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()))
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert abs(first - expected) < 1e-8, (first, expected)


def test_infer_generates_what_transformers_generates(qwen2, tmp_path, capsys):
    hf, path = qwen2
    prompt = [5, 17, 301, 42, 99, 7, 250, 3]
    summary = tmp_path / "s.json"
    assert infer.main(["--model_path", path, "--seq_length", "8", "--prompt_ids", ",".join(map(str, prompt)),
                       "--generate", "4", "--warmup", "0", "--reps", "1", "--override", "dtype=float64",
                       "--summary_json", str(summary)]) == 0
    capsys.readouterr()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    got = json.loads(summary.read_text())
    assert got["model"] == "qwen2" and got["new_tokens"] == ids[0, 8:].tolist()


def test_profile_counts_the_checkpoints_parameters(qwen2, tmp_path, capsys):
    hf, path = qwen2
    out = tmp_path / "p.json"
    assert profile.main(["--model_path", path, "--batch", "1", "--seq_len", "8", "--warm_up", "0", "--no_detailed",
                         "--json", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["config"]["model"]["model_type"] == "qwen2"
    assert data["params"]["global"] == sum(p.numel() for p in hf.parameters())


def refused(main, argv, capsys, monkeypatch, module) -> str:
    def no_ranks(*_):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(module, "launch_ranks", no_ranks)
    assert main(argv) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1, err
    return err[0]


def test_a_config_file_whose_model_disagrees_names_the_key(qwen2, capsys, monkeypatch):
    _, path = qwen2
    line = refused(pretrain.main, ["--config", CONFIG, "--model_path", path, "--world", "2"], capsys, monkeypatch,
                   pretrain)
    assert line == (f"error: config key 'model_type' is 'llama' in config file '{CONFIG}' but 'qwen2' in the "
                    f"checkpoint '{path}' (its config.json sets the model); drop 'model_type' from the config, or "
                    "--override model_type=... to change it")


def test_a_checkpoint_that_is_not_there_is_one_line(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope"
    for module in (pretrain, infer, profile):
        line = refused(module.main, ["--model_path", str(missing)], capsys, monkeypatch, module)
        assert line == (f"error: config key 'model_path' (--model_path): '{missing}' has no config.json (the path does "
                        "not exist); pass a local HF model directory"), module


def test_compare_with_a_missing_base_leaves_no_directory(tmp_path, capsys):
    out_dir = tmp_path / "cmp"
    assert compare.main(["--model_path", str(tmp_path / "nope"), "--out_dir", str(out_dir)]) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: config key 'model_path' (--model_path): "), err
    assert not out_dir.exists()
