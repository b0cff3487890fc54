"""A run's configuration (``galaxy.config.galaxy_config.GalaxyConfig``): what ``to_dict`` writes (checkpoints'
state.json, the configs the plan CLI writes, compare's runs) loads back through JSON as the same config, with
a preset's values overridden too; a preset's nested values are copied into each config, never shared with it.
(Loading and every check: tests/config/test_keys.py, test_checks.py, test_plan.py.)"""

import json

import pytest

from galaxy.config.galaxy_config import GalaxyConfig
from galaxy.config.presets import MODEL_PRESETS


@pytest.mark.parametrize("raw,overrides,set_after", [
    ({"model": {"preset": "llama-8b"}, "train": {"seq_length": 64}}, None, {}),
    ({"preset": "bert-tiny", "plan": "galaxy", "tp_num_attention_heads_list": [1, 1], "seq_scatter_list": [3, 5],
      "seq_length": 8}, {"num_hidden_layers": 1}, {}),
    ({"preset": "llama-tiny", "tuning": "lora", "dtype": "bfloat16", "dp_size": 2}, None, {"vocab_size": 300}),
])
def test_to_dict_loads_back_as_the_same_config(raw, overrides, set_after):
    cfg = GalaxyConfig.from_dict(raw, overrides)
    for key, value in set_after.items():  # as match_vocab sets the tokenizer's vocabulary after loading
        setattr(cfg.model, key, value)
    assert GalaxyConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_presets_nested_values_are_copied_into_each_config():
    factor = MODEL_PRESETS["llama-8b"]["rope_scaling"]["factor"]
    cfg = GalaxyConfig.from_dict({"model": {"preset": "llama-8b"}})
    cfg.model.rope_scaling["factor"] = factor * 2
    assert MODEL_PRESETS["llama-8b"]["rope_scaling"]["factor"] == factor
    assert GalaxyConfig.from_dict({"model": {"preset": "llama-8b"}}).model.rope_scaling["factor"] == factor
