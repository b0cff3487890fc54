"""Config loading and validation: every bad input is one clear error naming the key and the fix."""

import json
import re

import pytest

from galaxy.config import ConfigError, GalaxyConfig, Method, parse_override

BASE = dict(hidden_size=24, num_attention_heads=6, intermediate_size=40, seq_length=12, vocab_size=50)


def resolve(world, **extra):
    return GalaxyConfig.from_dict(dict(BASE, **extra)).resolve_plan(world)


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


def test_presets_and_overrides():
    cfg = GalaxyConfig.from_dict({"preset": "bert-large"}, {"num_hidden_layers": 2})
    assert cfg.model.hidden_size == 1024 and cfg.model.num_hidden_layers == 2
    assert parse_override("hidden_dropout_prob=0") == ("hidden_dropout_prob", 0)
    assert parse_override("plan=galaxy") == ("plan", "galaxy")


def test_default_splits_are_balanced():
    plan = resolve(4, plan="galaxy")
    assert plan.heads_split == (2, 2, 1, 1) and plan.seq_split == (3, 3, 3, 3) and sum(plan.ffn_split) == 40


@pytest.mark.parametrize("raw,overrides,needle", [
    ({"hiden_size": 3}, None, "did you mean 'hidden_size'"),
    ({"model": {"num_attention_head": 3}}, None, "did you mean 'num_attention_heads'"),
    ({"att_parallel_method": "XP"}, None, "unknown parallel method 'XP'"),
    ({"plan": "galaxy3"}, None, "unknown plan 'galaxy3'"),
    ({"con_parallel_method": "TP"}, None, "CON has no TP form"),
    ({"plan": "tp", "con_parallel_method": "SP"}, None, "plan 'tp' needs None"),
    ({"hidden_size": "big"}, None, "'hidden_size' must be int"),
    ({"seq_scatter_list": [1, "a"]}, None, "'seq_scatter_list' must be a list of int"),
    ({"use_lora": True, "use_adapter": True}, None, "more than one tuning method"),
    ({"dtype": "fp8"}, None, "'dtype'"),
    ({"hidden_size": 25}, None, "divisible by num_attention_heads"),
    ({"preset": "bert-huge"}, None, "unknown model preset"),
    ({}, {"seq_length": 5000}, "exceeds max_position_embeddings"),
    ({"lr": 0.0}, None, "config key 'lr' must be positive, got 0.0"),
    ({"weight_decay": -0.1}, None, "config key 'weight_decay' must be 0 or positive, got -0.1"),
    ({"grad_clip": -1.0}, None, "config key 'grad_clip' must be 0 or positive, got -1.0"),
    ({"use_lora": True, "lora_alpha": 0}, None, "config key 'lora_alpha' must be positive, got 0"),
])
def test_bad_config_is_one_clear_error(raw, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("'", "'")) as err:
        GalaxyConfig.from_dict(dict(BASE, **raw), overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("world,extra,needle", [
    (2, dict(plan="galaxy", tp_num_attention_heads_list=[6]), "has 1 entries but the model-parallel group has 2"),
    (2, dict(plan="galaxy", tp_num_attention_heads_list=[4, 3]), "sums to 7 but num_attention_heads is 6"),
    (2, dict(plan="galaxy", tp_intermediate_size_list=[50, -10]), "must hold positive splits"),
    (2, dict(plan="galaxy", seq_scatter_list=[4, 4]), "sums to 8 but seq_length is 12"),
    (3, dict(plan="sp", seq_scatter_list=[6, 6, 0]), "must hold positive splits"),
    (8, dict(plan="tp"), "world size 8 cannot be used: num_attention_heads"),
    (16, dict(plan="sp"), "world size 16 cannot be used: seq_length"),
])
def test_bad_plan_for_world_is_one_clear_error(world, extra, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        resolve(world, **extra)
    assert "\n" not in str(err.value)


def test_gqa_split_must_keep_groups():
    cfg = GalaxyConfig.from_dict(dict(model_type="llama", hidden_size=64, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=40, seq_length=12,
                                      plan="tp", tp_num_attention_heads_list=[3, 5]))
    with pytest.raises(ConfigError, match="multiple of 2"):
        cfg.resolve_plan(2)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        GalaxyConfig.from_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        GalaxyConfig.from_file(str(bad))


@pytest.mark.parametrize("extra,needle", [
    (dict(pp_size=2, stage_num_hidden_layers_list=[2]), "has 1 entries but pp_size is 2"),
    (dict(pp_size=2, stage_num_hidden_layers_list=[2, 2]), "sums to 4 but num_hidden_layers is 12"),
    (dict(pp_size=2, stage_num_hidden_layers_list=[12, 0]), "must hold positive layer counts"),
    (dict(pp_size=13), "'pp_size' (13) exceeds num_hidden_layers (12)"),
    (dict(dp_size=3, global_batch_size=8), "not divisible into dp_size=3 data-parallel shards"),
    (dict(dp_size=2, global_batch_size=8, num_microbatches=3), "does not divide the 4 rows of each data-parallel"),
    (dict(dp_size=0), "'dp_size' must be at least 1"),
    (dict(pipeline_schedule="interleaved"), "'pipeline_schedule': 'interleaved' is not one of gpipe, 1f1b"),
    (dict(pipeline_engine="megatron"), "'pipeline_engine': 'megatron' is not one of torch, galaxy"),
    (dict(dp_engine="fsdp"), "'dp_engine': 'fsdp' is not one of ddp, zero1, deepspeed"),
    (dict(zero_stage=3), "'zero_stage' must be 1 or 2"),
])
def test_bad_dp_pp_config_is_one_clear_error(extra, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        GalaxyConfig.from_dict(dict(BASE, **extra))
    assert "\n" not in str(err.value)


def test_world_is_dp_times_pp_times_mp():
    cfg = GalaxyConfig.from_dict(dict(BASE, dp_size=2, pp_size=3, num_hidden_layers=7))
    assert cfg.stage_layers() == (3, 2, 2) and cfg.mp_size(12) == 2 and cfg.mp_size(6) == 1
    with pytest.raises(ConfigError, match=re.escape("world size 8 is not divisible by dp_size x pp_size = 2 x 3 = 6")):
        cfg.mp_size(8)
    uneven = GalaxyConfig.from_dict(dict(BASE, pp_size=3, num_hidden_layers=7, stage_num_hidden_layers_list=[1, 5, 1]))
    assert uneven.stage_layers() == (1, 5, 1)
