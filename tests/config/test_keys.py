"""Config keys (``galaxy.config.keys``): nested and flat (Galaxy-LM) keys are one config; a missing or broken
file is one clear error."""

import json

import pytest

from galaxy.config import ConfigError, GalaxyConfig, Method


def test_nested_and_flat_keys_are_equivalent():
    nested = GalaxyConfig.from_dict({"model": {"hidden_size": 24, "num_attention_heads": 6},
                                     "train": {"seq_length": 12}, "parallel": {"plan": "galaxy"}})
    flat = GalaxyConfig.from_dict({"hidden_size": 24, "num_attention_heads": 6, "pad_size": 12,
                                   "att_parallel_method": "TP", "con_parallel_method": "SP",
                                   "mlp_parallel_method": "TP"})
    assert nested.model == flat.model and nested.train == flat.train
    assert nested.methods() == flat.methods() == (Method.TP, Method.SP, Method.TP)


def test_galaxy_lm_flat_file_is_accepted(tmp_path):
    legacy = {"pad_size": 32, "batch_size": 10, "learning_rate": 5e-5, "hidden_size": 48, "num_attention_heads": 6,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100, "hidden_act": "gelu",
              "con_parallel_method": "SP", "seq_scatter_list": [20, 12], "att_parallel_method": "TP",
              "tp_num_attention_heads_list": [3, 3], "mlp_parallel_method": "TP",
              "tp_intermediate_size_list": [48, 48], "init_method": "tcp://127.0.0.1:23000",
              "distributed_backend": "gloo", "use_lora": False, "lora_att_dim": 4, "lora_alpha": 32,
              "lora_dropout": 0.1, "fan_in_fan_out": True, "merge_weights": False, "directionality": "bidi"}
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps(legacy))
    cfg = GalaxyConfig.from_file(str(path))
    assert cfg.train.seq_length == 32 and cfg.train.global_batch_size == 10 and cfg.train.lr == 5e-5
    assert cfg.peft.lora_dim == 4
    plan = cfg.resolve_plan(2)
    assert plan.seq_split == (20, 12) and plan.heads_split == (3, 3)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        GalaxyConfig.from_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        GalaxyConfig.from_file(str(bad))
