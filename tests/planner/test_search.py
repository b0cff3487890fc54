"""galaxy.planner.search: the split search against brute force over every split scored by the same cost
model, its margins (uneven splits, more devices), device subsets, and GQA groups and units."""

import itertools
import math

import numpy as np
import pytest

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.planner.group import Segments
from galaxy.planner.search import SplitSearch, compositions, min_max_split, search
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Layout, Splits, Workload
from tests.planner.helpers import BERT, LLAMA, NONE, SP, TP, synthetic_cluster


@pytest.mark.parametrize("parts,units,seed", [(2, 9, 0), (3, 8, 1), (4, 7, 2), (3, 12, 3)])
def test_min_max_split_matches_brute_force(parts, units, seed):
    rng = np.random.default_rng(seed)
    costs = np.concatenate([np.zeros((parts, 1)), np.cumsum(rng.random((parts, units)), axis=1)], axis=1)
    x = min_max_split(costs, units)
    brute = min(max(costs[i, c[i]] for i in range(parts)) for c in compositions(units, parts))
    assert x.sum() == units and (x >= 1).all()
    assert max(costs[i, x[i]] for i in range(parts)) == pytest.approx(brute)


def brute_force(cluster, work, methods, layout, units):
    """Every joint split (heads x ffn x seq, in their units) scored one at a time."""
    best = math.inf
    mp = cluster.world // (layout.dp * layout.pp)
    for h, f, s in itertools.product(compositions(units["heads"][1], mp), compositions(units["ffn"][1], mp),
                                     compositions(units["seq"][1], mp)):
        split = Splits.one(h * units["heads"][0], f * units["ffn"][0], s * units["seq"][0])
        best = min(best, float(predict(cluster, work, methods, split, layout).time_s[0]))
    return best


@pytest.mark.parametrize("speeds,methods,objective,waited", [
    ([1.0, 1.0], (TP, SP, TP), "train", None),
    ([1.0, 2.5], (TP, SP, TP), "train", None),
    ([2.0, 1.0], (TP, SP, SP), "latency", None),
    ([1.0, 1.7, 3.0], (TP, SP, TP), "train", None),
    ([3.0, 1.0, 1.0], (SP, SP, TP), "latency", None),
    ([1.0, 2.5], (SP, SP, SP), "latency", 0.6),
    ([1.0, 1.7, 3.0], (SP, SP, TP), "train", 0.6),
])
def test_search_matches_brute_force(speeds, methods, objective, waited):
    cluster = synthetic_cluster(BERT, len(speeds), speeds, alpha=5e-5, beta=1e-9, waited=waited)
    work = Workload(cluster.model, objective, 2, 8)
    exact = SplitSearch(cluster, work, methods, Layout(), ffn_unit=8)
    best = brute_force(cluster, work, methods, Layout(), exact.units)
    found = exact.run()
    assert found.exact and found.time_s == pytest.approx(best, rel=1e-12)
    # the path for large split spaces (min-max start, coordinate descent) reaches it too
    descent = SplitSearch(cluster, work, methods, Layout(), ffn_unit=8, exact_limit=0).run()
    assert not descent.exact and descent.time_s == pytest.approx(best, rel=1e-9)
    # every stretch the bound is built from is a rank's own compute: never negative
    segments = Segments()
    predict(cluster, work, methods, Splits.balanced(cluster.model, 8, len(speeds)), Layout(), segments)
    assert min(part.min() for part in segments.parts) >= 0
    # and its lower bound holds, and is tight here (less so where the last member leaves later: the
    # bound charges each collective until the first member leaves)
    assert best * (0.95 if waited is None else 0.85) < descent.lower_bound_s <= best * (1 + 1e-12)


def test_even_split_is_kept_unless_an_uneven_one_wins_by_the_margin():
    """An uneven split predicted g faster than the even one of the same methods is chosen under a
    margin below g; under a margin above g the even split is, carrying the uneven one's time as the
    bound on what a split of those methods could gain. A bad margin is one line."""
    cluster = synthetic_cluster(BERT, 2, [1.0, 1.5], alpha=5e-5, beta=1e-9)
    work = Workload(cluster.model, "train", 2, 8)

    def tp(margin):
        return next(c for c in search(cluster, work, ffn_unit=8, top=100, split_margin=margin)
                    if c.methods == (TP, NONE, TP) and c.devices == (0, 1))

    uneven = tp(0.0)
    assert (uneven.heads, uneven.ffn) != ((2, 2), (32, 32)) and uneven.exact
    even_time = float(predict(cluster, work, (TP, NONE, TP), Splits.balanced(cluster.model, 8, 2)).time_s[0])
    gain = even_time / uneven.time_s - 1
    assert gain > 0
    assert tp(gain * 0.9).ffn == uneven.ffn
    even = tp(gain * 1.1)
    assert (even.heads, even.ffn) == ((2, 2), (32, 32)) and even.time_s == pytest.approx(even_time, rel=1e-12)
    assert not even.exact and even.lower_bound_s == uneven.time_s
    with pytest.raises(ConfigError, match="--split_margin"):
        search(cluster, work, ffn_unit=8, split_margin=-0.1)


def test_more_devices_come_first_only_where_they_win_by_the_margin():
    """Both devices predicted g faster than the fast one alone: first under a margin below g; under
    one above g the device alone is first and the plan on both stays in the table, which is
    otherwise in predicted order. A bad margin is one line."""
    cluster = synthetic_cluster(BERT, 2, [1.0, 1.5], alpha=0.0, beta=0.0)
    work = Workload(cluster.model, "latency", 2, 8)
    ranked = search(cluster, work, ffn_unit=8, top=100, device_margin=0.0)
    both, alone = ranked[0], next(c for c in ranked if len(c.devices) == 1)
    assert both.devices == (0, 1) and alone.devices == (1,)
    gain = alone.time_s / both.time_s - 1
    assert 0 < gain < 0.9
    assert search(cluster, work, ffn_unit=8, top=100, device_margin=gain * 0.9)[0].devices == (0, 1)
    held = search(cluster, work, ffn_unit=8, top=100, device_margin=gain * 1.1)
    assert held[0].devices == (1,) and held[0].time_s == alone.time_s
    assert [c.time_s for c in held[1:]] == sorted(c.time_s for c in held[1:]) and held[1].devices == (0, 1)
    assert len(held) == len(ranked)
    with pytest.raises(ConfigError, match="--device_margin"):
        search(cluster, work, ffn_unit=8, device_margin=1.0)


def test_search_over_device_subsets():
    """On a slow link the fastest device alone beats every plan over both; on a free link both
    devices win. Each subset's plans are the search over that subset's own profile."""
    from galaxy.cli.plan import plan_config

    for alpha, beta, want in ((5e-2, 1e-5, (1,)), (0.0, 0.0, (0, 1))):
        cluster = synthetic_cluster(BERT, 2, [1.0, 1.5], alpha=alpha, beta=beta)
        work = Workload(cluster.model, "latency", 2, 8)
        choices = search(cluster, work, ffn_unit=8, top=100)
        assert choices[0].devices == want
        assert {c.devices for c in choices} == {(0, 1), (0,), (1,)}
        alone = next(c for c in choices if c.devices == (1,))
        assert alone.methods == (NONE, NONE, NONE)
        assert alone.time_s == pytest.approx(float(predict(cluster.restrict((1,)), work, (NONE,) * 3,
                                                           Splits.balanced(cluster.model, 8, 1)).time_s[0]))
        config = plan_config(GalaxyConfig.from_dict({"model": BERT}), choices[0], 2)
        assert config.get("distributed", {}).get("devices") == (None if want == (0, 1) else list(want))


def test_splits_respect_gqa_groups_and_units():
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 2.2])
    work = Workload(cluster.model, "train", 2, 8)
    for choice in search(cluster, work, ffn_unit=8, top=50):
        assert all(h % 4 == 0 for h in choice.heads) and sum(choice.heads) == 8  # group of 4 query heads
        assert all(f % 8 == 0 and f > 0 for f in choice.ffn) and sum(choice.ffn) == 48
        assert sum(choice.seq) == 8 and min(choice.seq) > 0
    with pytest.raises(ConfigError, match="ffn_unit"):
        search(cluster, work, ffn_unit=5)
