"""The plan a config resolves to (``galaxy.config.plan``): balanced default splits, the world as dp x pp x mp,
and a plan the world cannot hold as one clear error."""

import re

import pytest

from galaxy.config import ConfigError, GalaxyConfig
from tests.config.helpers import BASE, resolve


def test_default_splits_are_balanced():
    plan = resolve(4, plan="galaxy")
    assert plan.heads_split == (2, 2, 1, 1) and plan.seq_split == (3, 3, 3, 3) and sum(plan.ffn_split) == 40


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


def test_world_is_dp_times_pp_times_mp():
    cfg = GalaxyConfig.from_dict(dict(BASE, dp_size=2, pp_size=3, num_hidden_layers=7))
    assert cfg.stage_layers() == (3, 2, 2) and cfg.mp_size(12) == 2 and cfg.mp_size(6) == 1
    with pytest.raises(ConfigError, match=re.escape("world size 8 is not divisible by dp_size x pp_size = 2 x 3 = 6")):
        cfg.mp_size(8)
    uneven = GalaxyConfig.from_dict(dict(BASE, pp_size=3, num_hidden_layers=7, stage_num_hidden_layers_list=[1, 5, 1]))
    assert uneven.stage_layers() == (1, 5, 1)
