"""Config validation (``galaxy.config.checks``): every bad value is one clear error naming the key and the fix."""

import re

import pytest

from galaxy.config import ConfigError, GalaxyConfig
from tests.config.helpers import BASE


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
