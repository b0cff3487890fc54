"""The checks every rank-starting command makes before any process starts (``galaxy.cli.run``): the plan a
config without one gets, a plan-specific CLI refusing another, the dimension a dp/pp CLI fills with the
world, and the device-bound settings refused on a CPU; each refusal one line naming the key or the CLI."""

import pytest

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.cli.run import check_engine, check_plan_for_cli, check_tp_overlap, fill_world

TINY = {"preset": "bert-tiny", "num_hidden_layers": 4}


def test_a_config_without_a_plan_gets_the_commands_and_a_strict_cli_refuses_another():
    cfg = GalaxyConfig.from_dict(TINY)
    check_plan_for_cli(cfg, "tp", 2, strict=False)
    assert cfg.parallel.plan == "tp"
    named = GalaxyConfig.from_dict(dict(TINY, plan="sp"))
    check_plan_for_cli(named, "tp", 2, strict=False)  # a config's own plan wins
    assert named.parallel.plan == "sp"
    with pytest.raises(ConfigError, match="runs the 'tp' plan but the config asks for SP/SP/SP"):
        check_plan_for_cli(named, "tp", 2, strict=True)
    with pytest.raises(ConfigError, match="the serial CLI runs on one rank, got --world 2"):
        check_plan_for_cli(GalaxyConfig.from_dict(TINY), "none", 2, strict=True)


@pytest.mark.parametrize("fill,world,extra,sizes", [
    ("dp", 4, {}, (4, 1)), ("pp", 4, {}, (1, 4)), ("dp", 4, {"pp_size": 2}, (2, 2)),
    ("dp", 4, {"plan": "tp"}, (1, 1)),  # an mp plan takes the ranks: nothing to fill
    (None, 4, {}, (1, 1)),
])
def test_a_dp_or_pp_cli_fills_its_dimension_with_the_world(fill, world, extra, sizes):
    cfg = GalaxyConfig.from_dict(dict(TINY, **extra))
    check_plan_for_cli(cfg, "none", world, strict=False)
    fill_world(cfg, world, fill)
    assert (cfg.parallel.dp_size, cfg.parallel.pp_size) == sizes


def test_device_bound_settings_are_refused_on_a_cpu():
    with pytest.raises(ConfigError, match="'dp_engine' is 'deepspeed' but the device is cpu"):
        check_engine(GalaxyConfig.from_dict(dict(TINY, dp_engine="deepspeed", dp_size=2, device="cpu")))
    check_engine(GalaxyConfig.from_dict(dict(TINY, dp_engine="deepspeed", device="cpu")))  # one replica: no ZeRO
    async_tp = GalaxyConfig.from_dict(dict(TINY, plan="tp", tp_overlap="async_tp", device="cpu"))
    with pytest.raises(ConfigError, match="'tp_overlap' is 'async_tp'.*this run uses device cpu"):
        check_tp_overlap(async_tp, 2)
    check_tp_overlap(async_tp, 1)  # one model-parallel rank has nothing to overlap
