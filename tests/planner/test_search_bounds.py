"""The search at scale: what lets it leave work out, checked against the work it leaves out.

References: the exhaustive search (``prune=False``, every layout of every group scored), the cost
model's plain step-by-step simulation (every layer and micro-batch run), and predictions of sampled
splits; the 7B search runs on the cluster profile measured on 4 x H200 (docs/results).
"""

import dataclasses
import itertools
import logging
import os
import sys

import numpy as np
import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig, Method
from galaxy.planner import bounds, group, memory, simulate, workload
from galaxy.planner.cluster import AlphaBeta, load_cluster
from galaxy.planner.bounds import might_fit
from galaxy.planner.group import Segments
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Layout, Workload
from galaxy.planner.search import (SplitSearch, beats_setting, compositions, engine_workload, engine_workloads,
                                   layouts, method_combinations, reduction_acts, search)
from tests import REPO
from tests.planner.helpers import BERT, LLAMA, model_config as model_config_of, synthetic_cluster

TP, SP, NONE = Method.TP, Method.SP, Method.NONE
H200X4 = os.path.join(REPO, "docs", "results", "cluster_2026-11-27_1aefcca_h200x4_llama7b.json")


def plan_key(c):
    return c.devices, c.methods, c.layout, c.heads, c.ffn, c.seq, round(c.time_s, 12), c.fits


@pytest.mark.parametrize("model,speeds,memory,top,waited,device_margin", [
    (BERT, [1.0, 2.5, 1.3], 2**18, 1, None, 0.03),  # some layouts fit, some tiers only with recomputation
    (dict(LLAMA, num_hidden_layers=4), [3.0, 1.0, 1.0, 2.0], 2**19, 3, 0.5, 0.03),  # four ranks: dp, pp, subsets
    (dict(LLAMA, num_hidden_layers=4), [1.0, 2.5, 1.3], 2**19, 3, None, 0.03),
    (BERT, [1.0, 1.0, 1.0], 2**17, 3, None, 0.03),  # nothing fits: every plan shown is one that does not
    (BERT, [1.0, 1.0, 1.0, 1.0], 2**30, 1, None, 0.03),  # everything fits
    # the fast device alone holds back the two-device plan, which more devices then do not beat by the
    # margin: a plan that is neither shown nor run still decides which one runs
    (dict(LLAMA, num_hidden_layers=4), [3.0, 1.0, 1.0, 2.0], 2**30, 2, None, 0.8),
])
def test_pruned_search_returns_the_exhaustive_plans(model, speeds, memory, top, waited, device_margin):
    cluster = synthetic_cluster(model, len(speeds), speeds, alpha=5e-5, beta=1e-9, memory=memory, waited=waited)
    work = Workload(cluster.model, "train", 8, 8)
    exhaustive = search(cluster, work, ffn_unit=8, top=top, prune=False, device_margin=device_margin)
    pruned = search(cluster, work, ffn_unit=8, top=top, device_margin=device_margin)
    assert [plan_key(c) for c in pruned] == [plan_key(c) for c in exhaustive]


def test_pruned_search_returns_the_exhaustive_plans_with_calibrated_activations():
    """Ranks whose saved bytes a GPU calibration scaled (``activation_scale``): the bounds prune with the same
    scaled bytes the predictions use, and at a budget where unscaled plans need recomputation the scale
    changes which plans lead."""
    plain = synthetic_cluster(dict(LLAMA, num_hidden_layers=4), 3, [1.0, 2.5, 1.3], alpha=5e-5, beta=1e-9,
                              memory=3 * 2**17)
    scaled = dataclasses.replace(plain, ranks=tuple(dataclasses.replace(r, activation_scale=a)
                                                    for r, a in zip(plain.ranks, (0.4, 0.7, 0.5))))
    work = Workload(plain.model, "train", 8, 8)
    tables = {}
    for name, cluster in (("plain", plain), ("scaled", scaled)):
        exhaustive = search(cluster, work, ffn_unit=8, top=3, prune=False)
        assert [plan_key(c) for c in search(cluster, work, ffn_unit=8, top=3)] == [plan_key(c) for c in exhaustive]
        tables[name] = [plan_key(c) for c in exhaustive]
    assert tables["plain"] != tables["scaled"]


def test_search_over_dp_engines_merges_each_engines_own_search():
    """``dp_engines``: the plans of the config's engine, and with dp > 1 those of each other engine,
    each what that engine's own search finds (its mp_grad_reduce made one it runs with), a dp-1
    plan once; pruned as the exhaustive search; every written config loads with its engine."""
    from galaxy.cli.plan import plan_config

    cluster = synthetic_cluster(dict(LLAMA, num_hidden_layers=4), 4, [1.0, 1.0, 1.0, 1.0], alpha=5e-5, beta=1e-9,
                                memory=2**20)
    # memory-bound work free (an optimizer step of fixed time): FSDP2's copies cost nothing, so that keeping
    # weights gathered saves no time and some FSDP2 settings are beaten by others on both time and memory
    cluster = dataclasses.replace(cluster, ranks=tuple(dataclasses.replace(r, optimizer=AlphaBeta(1e-4, 0.0))
                                                       for r in cluster.ranks))
    work = Workload(cluster.model, "train", 4, 8, mp_grad_reduce="sharded")  # dp 2 still has 2 micro-batches
    fsdp = engine_workload(work, "fsdp2")
    assert (fsdp.dp_engine, fsdp.mp_grad_reduce) == ("fsdp2", "after_backward")
    key = lambda c: repr((*plan_key(c), c.dp_engine, c.mp_grad_reduce, c.reshard_after_forward,  # noqa: E731
                          c.fsdp_grad_sync))
    merged = search(cluster, work, ffn_unit=8, top=500, device_margin=0.0, dp_engines=("fsdp2", "ddp"))
    variants = engine_workloads(work, "fsdp2")  # FSDP2 with and without resharding, syncing once or every time
    assert {(w.reshard_after_forward, w.fsdp_grad_sync) for w in variants} == {
        (r, g) for r in ("default", "never") for g in ("every_micro_batch", "last_micro_batch")}
    alone = {}
    for c in search(cluster, work, ffn_unit=8, top=500, device_margin=0.0) + [
            c for w in variants for c in search(cluster, w, ffn_unit=8, top=500, device_margin=0.0) if c.layout.dp > 1]:
        alone.setdefault(c.key, c)  # a setting that changes nothing on a layout (one micro-batch) is one plan
    undominated = [b for b in alone.values() if not any(beats_setting(a, b) for a in alone.values())]
    assert len(undominated) < len(alone)
    assert len(merged) < 500 and sorted(map(key, merged)) == sorted(map(key, undominated))
    assert {(c.dp_engine, c.mp_grad_reduce) for c in merged if c.layout.dp > 1} \
        == {("ddp", "sharded"), ("fsdp2", "after_backward")}
    engines = {c.engine for c in merged if c.layout.dp > 1 and c.layout.microbatches > 1}
    assert {"ddp", "fsdp2", "fsdp2-onesync"} <= engines \
        <= {"ddp", "fsdp2", "fsdp2-noreshard", "fsdp2-onesync", "fsdp2-noreshard-onesync"}
    assert merged[0].time_s == min(c.time_s for c in alone.values() if c.fits)
    exhaustive = search(cluster, work, ffn_unit=8, top=5, prune=False, dp_engines=("fsdp2",))
    assert list(map(key, search(cluster, work, ffn_unit=8, top=5, dp_engines=("fsdp2",)))) \
        == list(map(key, exhaustive))
    cfg = GalaxyConfig.from_dict({"model": dict(LLAMA, num_hidden_layers=4)},
                                 {"global_batch_size": 4, "seq_length": 8})
    for c in (c for c in merged if c.layout.dp > 1 and c.fits):
        config = plan_config(cfg, c, 4)
        assert (config["parallel"]["dp_engine"], config["parallel"]["mp_grad_reduce"]) == (c.dp_engine,
                                                                                           c.mp_grad_reduce)
        GalaxyConfig.from_dict(config).resolve_plan(4 // (c.layout.dp * c.layout.pp))
    kept = dataclasses.replace(fsdp, reshard_after_forward="never", fsdp_grad_sync="last_micro_batch")
    plans = search(cluster, kept, ffn_unit=8, top=500, device_margin=0.0, dp_engines=("ddp",))
    engines = {c.engine for c in plans}  # the config's own FSDP2 settings searched, each where it acts
    assert any("noreshard" in e for e in engines) and any("onesync" in e for e in engines), engines
    for c in plans:
        parallel = plan_config(cfg, c, 4)["parallel"]  # FSDP2's settings go with FSDP2 plans, where they act
        fsdp_keys = {k: parallel.get(k) for k in ("reshard_after_forward", "fsdp_grad_sync")}
        acting = c.dp_engine == "fsdp2" and c.layout.dp > 1
        assert fsdp_keys == {"reshard_after_forward": "never" if acting and c.layout.pp == 1 else None,
                             "fsdp_grad_sync": "last_micro_batch" if acting and c.layout.microbatches > 1 else None}
        if c.fits:
            GalaxyConfig.from_dict(plan_config(cfg, c, 4)).resolve_plan(
                len(c.devices) // (c.layout.dp * c.layout.pp))
    with pytest.raises(ConfigError, match="--dp_engines: 'zero3'"):
        search(cluster, work, ffn_unit=8, dp_engines=("zero3",))


def test_search_over_mp_grad_reduces_merges_each_reductions_own_search():
    """``mp_grad_reduces``: beside the config's reduction, with mp > 1 the plans of each other one its dp
    engine runs (FSDP2 takes no sharded) where it acts, each what that reduction's own search finds, an mp-1
    plan once; every written config loads; bad names are one line."""
    from galaxy.cli.plan import plan_config

    cluster = synthetic_cluster(dict(LLAMA, num_hidden_layers=4), 2, [1.0, 1.0], alpha=5e-5, beta=1e-9, memory=2**20)
    work = Workload(cluster.model, "train", 8, 8)
    key = lambda c: repr((*plan_key(c), c.dp_engine, c.mp_grad_reduce))  # noqa: E731
    merged = search(cluster, work, ffn_unit=8, top=500, device_margin=0.0, dp_engines=("fsdp2",),
                    mp_grad_reduces=("sharded", "fsdp"))
    # two ranks: mp 2 leaves no dp, so FSDP2 plans are dp-2 ones, which have no mp to reduce over
    assert {(c.dp_engine, c.mp_grad_reduce) for c in merged if len(c.seq) > 1} == {
        ("ddp", "after_backward"), ("ddp", "sharded"), ("ddp", "fsdp")}
    assert {c.mp_grad_reduce for c in merged if len(c.seq) == 1} == {"after_backward"}
    alone = {}
    for w in (work, *(dataclasses.replace(work, mp_grad_reduce=r) for r in ("sharded", "fsdp"))):
        for c in search(cluster, w, ffn_unit=8, top=500, device_margin=0.0):
            if w is work or (len(c.seq) > 1 and reduction_acts(c.methods, w.mp_grad_reduce)):
                alone.setdefault(c.key, c)
    ddp = sorted(key(c) for c in merged if c.dp_engine == "ddp")
    assert ddp == sorted(map(key, alone.values()))
    cfg = GalaxyConfig.from_dict({"model": dict(LLAMA, num_hidden_layers=4)}, {"global_batch_size": 8, "seq_length": 8})
    for c in (c for c in merged if c.fits):
        GalaxyConfig.from_dict(plan_config(cfg, c, 2)).resolve_plan(2 // (c.layout.dp * c.layout.pp))
    # a reduction runs only where it acts (FSDP over mp: an SP ATT or MLP); there galaxy2's MLP sharded over
    # mp holds less than ZeRO-2 over mp, which holds less than the whole MLP
    assert all(reduction_acts(c.methods, c.mp_grad_reduce) for c in merged if c.mp_grad_reduce != "after_backward")
    one = {c.mp_grad_reduce: max(c.memory_bytes) for c in merged
           if c.name == "galaxy2" and c.layout == Layout() and c.heads == (4, 4)}
    assert one["fsdp"] < one["sharded"] < one["after_backward"], one
    with pytest.raises(ConfigError, match="--mp_grad_reduces: 'zero3' is not one of"):
        search(cluster, work, ffn_unit=8, mp_grad_reduces=("zero3",))


@pytest.mark.parametrize("engine,reduce", [("fsdp2", "after_backward"), ("ddp", "fsdp")])
def test_fsdp2_settings_are_written_as_they_act(engine, reduce):
    """A plan's FSDP settings mean what the workload's did on its layout, and are the defaults wherever
    those act alike (so two variants of one run are one plan, and configs name only what changes a run):
    FSDP2 acts with dp > 1, ``mp_grad_reduce: fsdp`` with mp > 1."""
    from galaxy.planner.workload import fsdp_reshards, fsdp_syncs_once
    from galaxy.planner.search import fsdp_settings

    for reshard in ("default", "always", "never"):
        for sync in ("every_micro_batch", "last_micro_batch"):
            for size, pp, M in itertools.product((1, 2), (1, 2), (1, 2)):
                work = Workload(None, "train", 8, 8, dp_engine=engine, mp_grad_reduce=reduce,
                                reshard_after_forward=reshard, fsdp_grad_sync=sync)
                dp, mp = (size, 1) if engine == "fsdp2" else (1, size)
                canon_reshard, canon_sync = fsdp_settings(work, Layout(dp=dp, pp=pp, microbatches=M), mp)
                if size == 1:
                    assert (canon_reshard, canon_sync) == ("default", "every_micro_batch")
                    continue
                assert fsdp_reshards(canon_reshard, pp) == fsdp_reshards(reshard, pp)
                assert fsdp_syncs_once(canon_sync, M) == fsdp_syncs_once(sync, M)
                assert (canon_reshard == "default") == (fsdp_reshards(reshard, pp) == fsdp_reshards("default", pp))
                assert (canon_sync == "every_micro_batch") == (not fsdp_syncs_once(sync, M))


def test_fsdp2_traffic_hides_behind_compute_only_as_far_as_it_lasts():
    """FSDP2's gathers and reduce-scatters over dp (``simulate.fsdp_exposed``): on a link fast against the
    compute a micro-batch waits only for the root's and first layer's gather and the last reduce-scatters;
    on a slow link the step takes at least the whole traffic; and there the search puts dp on DDP (one
    all-reduce of the gradients) rather than FSDP2 (every weight gathered twice and reduce-scattered per
    micro-batch), where FSDP2 wins on a fast one (1 GB/s here: its traffic hidden, where DDP's all-reduce after
    the backward waits, and costs more than FSDP2's copies; on a link faster still, DDP's all-reduce costs
    less than those copies)."""
    model = dict(LLAMA, num_hidden_layers=4)
    work = Workload(model_config_of(model), "train", 8, 8, dp_engine="fsdp2")
    layout, M, layers = Layout(dp=2, microbatches=2), 2, 4
    split = workload.Splits.balanced(work.model, 8, 1)
    none = (NONE, NONE, NONE)

    def step(alpha, beta):
        cluster = synthetic_cluster(model, 2, [1.0, 1.0], alpha=alpha, beta=beta)
        return cluster, float(predict(cluster, work, none, split, layout).time_s[0])

    _, free = step(0.0, 0.0)
    fast, t_fast = step(1e-9, 1e-15)
    ab = fast.collective([0, 1], "all_gather")  # one alpha-beta for every op of the synthetic cluster
    emb, head = workload.edge_params(work.model)
    params = memory.stage_parameters(work, none, split, layout, 1)[0][0][0, 0]
    per_layer = (params - emb - head) / layers
    edges = 2 * ab((emb + head) * 4) + ab(per_layer * 4) + ab(per_layer * 4)  # fp32 (float32 run)
    scalars = 3 * ab(8)  # the loss, its token count and the squared gradient norm, summed over dp
    assert t_fast - free == pytest.approx(M * edges + scalars, rel=1e-6)
    slow, t_slow = step(1e-3, 1e-6)
    ab = slow.collective([0, 1], "all_gather")
    traffic = M * (2 * ab((emb + head) * 4) + layers * (2 * ab(per_layer * 4) + ab(per_layer * 4)))
    assert t_slow >= traffic
    kept = dataclasses.replace(work, reshard_after_forward="never", fsdp_grad_sync="last_micro_batch")
    pred_kept, pred = (predict(slow, w, none, split, layout) for w in (kept, work))
    once = M * (ab((emb + head) * 4) + layers * ab(per_layer * 4)) + ab((emb + head) * 4) + layers * ab(per_layer * 4)
    assert once <= pred_kept.time_s[0] < pred.time_s[0]  # one gather a micro-batch, one reduce-scatter a step
    held = float(pred_kept.memory_bytes[0, 0] - pred.memory_bytes[0, 0])  # every layer gathered, whole fp32 grads
    assert held == pytest.approx(per_layer * 4 * (layers - 2) + params * 4 / 2, rel=1e-9)
    for cluster, engine in ((synthetic_cluster(model, 2, [1.0, 1.0], alpha=1e-9, beta=1e-9), "fsdp2"), (slow, "ddp")):
        ddp = dataclasses.replace(work, dp_engine="ddp")
        plans = [c for c in search(cluster, ddp, ffn_unit=8, top=50, dp_engines=("fsdp2",)) if c.layout.dp > 1]
        assert plans[0].dp_engine == engine, [(c.dp_engine, c.time_s) for c in plans[:4]]


def test_fsdp2_copies_cost_their_bytes_at_the_optimizers_memory_rate():
    """FSDP2's copies around its collectives (each gather: the fp32 shard cast to bf16 and copied into the
    gather's buffer, the gathered buffer split into the weights; each micro-batch's gradients cast to fp32
    into the reduce-scatter's buffer, from the second on the reduced shard added to the sharded gradient)
    cost their bytes at the rank's memory-bound rate, its fused AdamW's seconds per parameter over the 28
    bytes it moves: on free links a rank whose optimizer runs twice as slowly pays for them twice. DDP,
    whose all-reduce reads the gradients in place, pays only its optimizer's difference."""
    model = dict(LLAMA, num_hidden_layers=4)
    layout, layers = Layout(dp=2, microbatches=2), 4
    none = (NONE, NONE, NONE)
    fsdp = Workload(model_config_of(model), "train", 8, 8, "bfloat16", dp_engine="fsdp2")
    split = workload.Splits.balanced(fsdp.model, 8, 1)

    def step(work, s_per_param):
        free = synthetic_cluster(model, 2, [1.0, 1.0], alpha=0.0, beta=0.0)
        slowed = dataclasses.replace(free, ranks=tuple(dataclasses.replace(r, optimizer=AlphaBeta(0.0, s_per_param))
                                                      for r in free.ranks))
        return float(predict(slowed, work, none, split, layout).time_s[0])

    params = memory.stage_parameters(fsdp, none, split, layout, 1)[0][0][0, 0]
    edges = sum(workload.edge_params(fsdp.model))
    per_layer = (params - edges) / layers
    # a layer's bytes: 2 micro-batches x 2 gathers x (shard: read 4 + write 2 cast, read 2 + write 2 copied in;
    # whole: read 2 + write 2 split out) + gradients (read 2, write 4) in both and the shard's add (read 8, write
    # 4) in the second; the root's (embeddings, head) stay fp32: one gather a micro-batch, 4-byte gradients
    layer_bytes = 2 * 2 * (per_layer / 2 * 10 + per_layer * 4) + 2 * per_layer * 6 + per_layer / 2 * 12
    root_bytes = 2 * (edges / 2 * 8 + edges * 8) + 2 * edges * 8 + edges / 2 * 12
    extra = 1e-9
    slower = step(fsdp, 2 * extra) - step(fsdp, extra)
    assert slower == pytest.approx(params / 2 * extra + (layers * layer_bytes + root_bytes) * extra / 28, rel=1e-9)
    ddp = dataclasses.replace(fsdp, dp_engine="ddp")
    assert step(ddp, 2 * extra) - step(ddp, extra) == pytest.approx(params * extra, rel=1e-9)


def sampled_splits(search_: SplitSearch, rng, count=200) -> dict:
    grids = {v: compositions(search_.units[v][1], search_.mp) for v in search_.uses}
    return {v: g[rng.integers(0, len(g), count)] for v, g in grids.items()}


def every_layout(cluster, work):
    """Every layout of every method combination the search scores (``method_combinations``)."""
    for tier in layouts(cluster, work):
        for layout in tier:
            for methods in method_combinations(cluster.world // (layout.dp * layout.pp)):
                s = SplitSearch(cluster, work, methods, layout, ffn_unit=8)
                if s.feasible():
                    yield s


@pytest.mark.parametrize("speeds,waited,beta", [
    ([1.0, 2.5], None, 1e-9), ([1.0, 1.7, 3.0], 0.6, 1e-9), ([3.0, 1.0, 1.0, 2.0], 0.5, 1e-9),
    ([1e3, 1e3, 2e3, 1e3], None, 1e-6),  # nearly all collectives: the bound is nearly the time, each sync counts
])
def test_bounds_hold_for_every_layout(speeds, waited, beta):
    """No sampled split of any layout (dp, pp, micro-batches, recomputation; each dp engine and
    gradient reduction) is predicted faster than ``lower_bound``, nor fits where ``might_fit`` says
    none does; and the time bound is reached within a few percent by the best split of a small
    layout (so it is a bound worth having)."""
    rng = np.random.default_rng(len(speeds))
    proven = 0
    workloads = [("train", "ddp", "after_backward"), ("train", "zero1", "sharded"),
                 ("train", "fsdp2", "after_backward"), ("train", "fsdp2", "fsdp"),  # FSDP over dp, mp and both
                 ("latency", "ddp", "after_backward")]
    budgets = [synthetic_cluster(dict(LLAMA, num_hidden_layers=4), len(speeds), speeds, alpha=5e-5, beta=beta,
                                 memory=memory, waited=waited) for memory in (2**18, 2**19)]
    for objective, engine, reduce in workloads:
        work = Workload(budgets[0].model, objective, 8, 8, "bfloat16", dp_engine=engine, mp_grad_reduce=reduce)
        for s in every_layout(budgets[0], work):
            bound = s.lower_bound()  # over every split, memory budgets ignored: the same under either
            for cluster in budgets:
                pred = predict(cluster, work, s.methods, s.splits(sampled_splits(s, rng)), s.layout)
                assert bound <= pred.time_s.min() * (1 + 1e-12), (s.methods, s.layout)
                if not might_fit(cluster, work, s.methods, s.layout, s.units, s.uses):
                    proven += 1
                    assert not pred.fits.any(), (s.methods, s.layout)
    assert proven > 0
    cluster = synthetic_cluster(BERT, len(speeds), speeds, alpha=5e-5, beta=beta, waited=waited)
    work = Workload(cluster.model, "train", 4, 8)
    for layout in (Layout(), Layout(1, 1, 2, "full")):
        exact = SplitSearch(cluster, work, (TP, SP, TP), layout, ffn_unit=8).run()
        assert exact.exact and exact.time_s * 0.9 < exact.lower_bound_s <= exact.time_s * (1 + 1e-12)


def test_bound_points_keep_every_piece_linear_between_them():
    """With fewer points than shares, each piece's least value between two points is at one of them:
    checked on every share of the 7B profile's pieces."""
    cluster = load_cluster(H200X4)
    rank = cluster.ranks[0]
    for var, unit, count in (("ffn", 1, 11008), ("seq", 1, 4096)):
        points = bounds.bound_points(cluster, var, unit, count, most=32)
        assert len(points) < count and points[0] == 1 and points[-1] == count
        shares = np.arange(1, count + 1)
        for name in bounds.SIZED_BY[var]:
            for rows in (1, 3, 16):  # measured, between, beyond
                for values in rank.piece(name, rows, shares)[:2]:
                    least = np.minimum.reduceat(values, points[:-1] - 1)  # each [p_k, p_k+1) stretch
                    ends = np.minimum(values[points[:-1] - 1], values[points[1:] - 1])
                    assert (least >= ends - 1e-15).all(), (var, name, rows)


def test_repeated_layers_and_micro_batches_are_simulated_exactly(monkeypatch):
    """``GroupModel.repeat`` stops simulating once two steps in a row see the same last members; the
    times and recorded stretches equal those of running every layer and micro-batch."""
    cluster = synthetic_cluster(dict(LLAMA, num_hidden_layers=5), 3, [1.0, 1.7, 3.0], alpha=5e-5, beta=1e-9,
                                waited=0.4)
    rng = np.random.default_rng(3)
    cases = []
    for objective in ("train", "latency"):
        work = Workload(cluster.model, objective, 12, 8)
        for s in every_layout(cluster, work):
            if s.layout.recompute not in ("selective", "mlp"):
                cases.append((work, s, s.splits(sampled_splits(s, rng, 20)) if s.uses else s.splits({})))

    def simulate(record):
        out = []
        for work, s, splits in cases:
            segments = Segments() if s.layout.dp * s.layout.pp == 1 else None
            pred = predict(cluster, work, s.methods, splits, s.layout, segments)
            out.append((pred.time_s, pred.memory_bytes, segments and (segments.parts, segments.comm)))
        return out

    shortcut = simulate(False)

    def every_step(self, step, clock, times):
        for _ in range(times):
            clock = step(clock)
        return clock

    monkeypatch.setattr(group.GroupModel, "repeat", every_step)
    for (t, mem, seg), (t0, mem0, seg0) in zip(shortcut, simulate(True)):
        np.testing.assert_allclose(t, t0, rtol=1e-12)
        np.testing.assert_array_equal(mem, mem0)
        if seg0 is not None:
            assert len(seg[0]) == len(seg0[0]) and len(seg[1]) == len(seg0[1])
            for a, b in zip(seg[0] + seg[1], seg0[0] + seg0[1]):
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-15)


def test_search_of_llama_7b_on_four_gpus_at_global_batch_16(caplog):
    """The search that did not finish (issue 31: LLaMA-7B, 16 x 4096 tokens, 4 x H200, bf16): it
    scores a few dozen layouts of the ~4,000, and every plan it returns is what the cost model says
    of it, the first within the budgets, each no faster than its lower bound."""
    cluster = load_cluster(H200X4)
    cfg = GalaxyConfig.from_dict({"model": {"preset": "llama-7b"}},
                                 {"global_batch_size": 16, "seq_length": 4096, "dtype": "bfloat16"})
    work = Workload(cfg.model, "train", 16, 4096, "bfloat16")
    with caplog.at_level(logging.INFO, logger="galaxy.planner.search"):
        plans = search(cluster, work, top=10)
    searched = [r for r in caplog.records if "split searches" in r.getMessage()]
    assert searched and searched[0].args[2] < 200
    assert len(plans) == 10 and plans[0].fits and len(plans[0].devices) == 4
    for c in plans:
        sub = cluster.restrict(c.devices)
        pred = predict(sub, work, c.methods, workload.Splits.one(c.heads, c.ffn, c.seq), c.layout)
        assert pred.time_s[0] == pytest.approx(c.time_s, rel=1e-9) and bool(pred.fits[0]) == c.fits
        assert c.lower_bound_s <= c.time_s * (1 + 1e-12)
    assert [c.time_s for c in plans[1:]] == sorted(c.time_s for c in plans[1:])


def fsdp_state_bytes(ctx, case):
    """This rank's bytes of parameters and gradients after a backward and of AdamW's moments after the
    step under ``dp_engine: fsdp2``, and of the vectors (norm scales) FSDP leaves whole."""
    from galaxy.core.fsdp import local
    from galaxy.train.loop import Trainer
    from tests.core.test_dp_pp import build

    cfg, _, model, _, batch_at = build(ctx, case)
    trainer = Trainer(model, cfg, ctx)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = trainer.forward_backward(trainer.read_batch(batch_at, 0))
    nbytes = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    total = sum(nbytes(p) + nbytes(p.grad) for p in params)
    trainer.optimizer_step(loss, 1)
    total += sum(nbytes(trainer.optimizer.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq"))
    vectors = sum(p.numel() for p in params if p.dim() < 2)
    trainer.grad_sync.remove()
    return total, vectors


# FSDP2's copies as the cost model counts them (``simulate.fsdp_copy_bytes``), by the op each runs in torch's
# fully_shard: op -> (bytes read, bytes written) of (args, kwargs, out)
FSDP_COPIES = {
    "fsdp.all_gather_copy_in": lambda a, k, out: (nbytes(a[0]), a[3] * a[1].element_size()),
    "fsdp.split_with_sizes_copy": lambda a, k, out: (nbytes(a[0]), nbytes(k["out"])),
    "fsdp.chunk_cat": lambda a, k, out: (nbytes(a[0]), nbytes(k["out"])),
    "aten._to_copy": lambda a, k, out: (nbytes(a[0]), nbytes(out)),
    "aten._foreach_copy_": lambda a, k, out: (nbytes(a[1]), nbytes(a[0])),
    "aten.copy_": lambda a, k, out: (nbytes(a[1]), nbytes(a[0])),
    "aten.add_": lambda a, k, out: (nbytes(a[:2]), nbytes(a[0])),
}
# what else fully_shard runs around its collectives, moving no data (views, allocations, storage resizes)
FSDP_NO_COPY = {"aten.view", "aten._unsafe_view", "aten.as_strided", "aten.split_with_sizes", "aten.split",
                "aten.narrow", "aten.slice", "aten.empty", "aten.empty_strided", "aten.new_empty",
                "aten.new_empty_strided", "aten.detach", "aten.alias", "aten.set_", "aten.resize_",
                "aten.t", "aten.reshape", "aten.expand", "aten.lift_fresh", "aten.is_same_size"}


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


def fsdp_copied_bytes(ctx, case):
    """Bytes torch's fully_shard reads and writes in ops issued from its own code (not its collectives)
    during a training step's forward and backward of ``case``, by op, and the ops it ran that move none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from galaxy.models.llama import LlamaForCausalLM
    from galaxy.train.loop import Trainer, autocast_context
    from tests.core.test_dp_pp import LLAMA as MODEL, TRAIN, llama_batch_at

    distributed = os.sep + os.path.join("torch", "distributed") + os.sep
    inside = os.sep + os.path.join("fsdp", "_fully_shard") + os.sep

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.other = {}, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # the innermost frame of torch.distributed: fully_shard's own code, or a collective's (Gloo
            # emulates a reduce-scatter with copies that NCCL does not make)
            frame = sys._getframe(1)
            while frame is not None and distributed not in frame.f_code.co_filename:
                frame = frame.f_back
            op = f"{func.namespace}.{func.__name__.split('.')[0]}"
            if frame is not None and inside in frame.f_code.co_filename and func.namespace not in ("c10d", "profiler"):
                if op in FSDP_COPIES:
                    read, written = FSDP_COPIES[op](args, kwargs, out)
                    self.bytes[op] = self.bytes.get(op, 0) + read + written
                elif op not in FSDP_NO_COPY:
                    self.other.add(f"{op} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
            return out

    cfg = GalaxyConfig.from_dict(dict(MODEL, **dict(TRAIN, **case)))
    ctx.stage_layers = cfg.stage_layers()
    trainer = Trainer(LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11), cfg, ctx)
    batch = trainer.read_batch(llama_batch_at, 0)
    with Count() as count:
        trainer.forward_backward(batch, lambda: autocast_context(cfg, ctx.device))
    trainer.grad_sync.remove()
    return count.bytes, sorted(count.other)


@pytest.mark.parametrize("sync,reshard", [("every_micro_batch", "default"), ("last_micro_batch", "never")])
def test_fsdp2_copies_are_the_bytes_fully_shard_copies(dist_pool, sync, reshard):
    """The bytes the cost model charges for FSDP2's copies (``simulate.fsdp_copy_bytes``: casts, the gather's
    copy-in and split, the reduce-scatter's copy-in, the sharded gradients' adds; per micro-batch, in
    both gradient syncs and with and without resharding) are the bytes torch's fully_shard moves in
    those ops, counted op by op in a real step on dp 2 (bf16 weights gathered, fp32 masters and
    reductions, 2 micro-batches), and it runs no other op that moves data. The cost model counts the
    norm scales as sharded, which FSDP leaves whole: without them its bytes are FSDP's."""
    from tests.core.test_dp_pp import LLAMA as MODEL, TRAIN

    case = dict(plan="none", dp_size=2, dp_engine="fsdp2", dtype="bfloat16", num_microbatches=2,
                fsdp_grad_sync=sync, reshard_after_forward=reshard)
    measured = dist_pool.run(fsdp_copied_bytes, 2, case, dp=2)
    cfg = GalaxyConfig.from_dict(dict(MODEL, **dict(TRAIN, **case)))
    work = Workload(cfg.model, "train", TRAIN["global_batch_size"], TRAIN["seq_length"], "bfloat16",
                    dp_engine="fsdp2", reshard_after_forward=reshard, fsdp_grad_sync=sync)
    layout = Layout(dp=2, microbatches=2)
    params = memory.stage_parameters(work, (NONE, NONE, NONE),
                                     workload.Splits.balanced(cfg.model, TRAIN["seq_length"], 1), layout, 1)[0][0]
    u, = memory.FsdpUnits.of(work, layout, 0, params)
    gathers = 2 if workload.fsdp_reshards(reshard, 1) else 1
    once = workload.fsdp_syncs_once(sync, 2)
    h = MODEL["hidden_size"]  # norm scales (2 a layer, the final one in the root): whole in FSDP, sharded in the model

    def predicted(per_layer, edge):
        return float(sum(u.layers * simulate.fsdp_copy_bytes(per_layer, u.compute, u.master, 2, gathers, k, 2, once)
                         + simulate.fsdp_copy_bytes(np.full(1, edge), u.master, u.master, 2, 1, k, 2, once)
                         for k in range(2))[0])
    for copied, other in measured:
        assert not other, other
        assert set(copied) >= {"fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy", "fsdp.chunk_cat"}, copied
        total = sum(copied.values())
        matrices = predicted(u.per_layer[:, 0] - 2 * h, u.edge - h)
        assert matrices == pytest.approx(total, rel=1e-12), sorted(copied.items())
        assert predicted(u.per_layer[:, 0], u.edge) > total


def test_fsdp2_memory_is_a_dp_block_of_masters_gradients_and_moments(dist_pool):
    """dp 2 x galaxy mp 2 on FSDP2: each rank holds 1/dp of its mp rank's master weights, gradients and
    AdamW moments (float64 here) as the cost model says; FSDP leaves the vectors whole, which the
    cost model counts as sharded (their other half is all it misses)."""
    from tests.core.test_dp_pp import LLAMA as MODEL, TRAIN

    case = dict(model="llama", plan="galaxy", dp_size=2, dp_engine="fsdp2")
    measured = dist_pool.run(fsdp_state_bytes, 4, case, dp=2)
    cfg = GalaxyConfig.from_dict(dict(MODEL, **TRAIN, **{k: v for k, v in case.items() if k != "model"}))
    work = Workload(cfg.model, "train", TRAIN["global_batch_size"], TRAIN["seq_length"], "float64",
                    dp_engine="fsdp2")
    splits = workload.Splits.balanced(cfg.model, TRAIN["seq_length"], 2)
    params, _, stepped, _ = memory.stage_parameters(work, (TP, SP, TP), splits, Layout(dp=2), 2)
    per_param, _ = memory.bytes_per_parameter(work, 2, 2, 1)
    for rank, (total, vectors) in enumerate(measured):
        predicted = params[0][0, rank % 2] * per_param
        assert predicted <= total <= predicted + vectors * per_param, (rank, total, predicted)
        assert stepped[0][0, rank % 2] == params[0][0, rank % 2] / 2  # the optimizer steps the dp block


@pytest.mark.parametrize("world,case", [
    (2, dict(plan="galaxy2", mp_grad_reduce="fsdp")),
    (4, dict(plan="galaxy2", mp_grad_reduce="fsdp", dp_size=2, dp_engine="fsdp2")),
])
def test_mp_fsdp_memory_is_an_mp_block_of_the_replicated_weights(dist_pool, world, case):
    """``mp_grad_reduce: fsdp`` (galaxy2's SP MLP sharded over mp 2; with FSDP2 over dp 2 x mp 2): each rank
    holds 1/mp (1/(dp mp)) of the MLP's master weights, gradients and AdamW moments and its own share of
    the rest (float64), as ``stage_parameters`` and ``bytes_per_parameter`` say; FSDP leaves the vectors
    whole, which the cost model counts as sharded where FSDP2 shards over dp."""
    from tests.core.test_dp_pp import LLAMA as MODEL, TRAIN

    case = dict(case, model="llama")
    dp, mp = case.get("dp_size", 1), world // case.get("dp_size", 1)
    measured = dist_pool.run(fsdp_state_bytes, world, case, dp=dp)
    cfg = GalaxyConfig.from_dict(dict(MODEL, **TRAIN, **{k: v for k, v in case.items() if k != "model"}))
    work = Workload(cfg.model, "train", TRAIN["global_batch_size"], TRAIN["seq_length"], "float64",
                    mp_grad_reduce="fsdp", dp_engine=case.get("dp_engine", "ddp"))
    splits = workload.Splits.balanced(cfg.model, TRAIN["seq_length"], mp)
    params, partial, stepped, replicated = memory.stage_parameters(work, (TP, SP, SP), splits, Layout(dp=dp), mp)
    mlp = 3 * MODEL["hidden_size"] * MODEL["intermediate_size"] * MODEL["num_hidden_layers"]
    assert (replicated[0] == mlp).all()  # the MLP's three matrices of every layer
    per_param, per_replicated = memory.bytes_per_parameter(work, dp, mp, 1)
    assert per_replicated == 32 / (dp * mp)  # master, gradient and two moments, 8 bytes each
    for rank, (total, vectors) in enumerate(measured):
        i = rank % mp
        predicted = (params[0][0, i] - replicated[0][0, i]) * per_param + replicated[0][0, i] * per_replicated
        whole_vectors = vectors * (32 - per_param)  # FSDP2's predicted shards of what it leaves whole
        assert predicted <= total <= predicted + whole_vectors, (rank, total, predicted)
        assert stepped[0][0, i] == (params[0][0, i] - replicated[0][0, i] * (1 - 1 / mp)) / dp


def test_mp_fsdp_copies_are_the_bytes_fully_shard_copies(dist_pool):
    """The copies ``mp_grad_reduce: fsdp`` makes around its collectives (galaxy2's MLP over mp 2, bf16
    gathers, fp32 masters and reductions, 2 micro-batches) are ``simulate.fsdp_copy_bytes`` of the MLP's
    weights over the mp group, to the byte (the unit holds no vector), and nothing else of fully_shard's
    moves data."""
    from tests.core.test_dp_pp import LLAMA as MODEL, TRAIN

    case = dict(plan="galaxy2", mp_grad_reduce="fsdp", dtype="bfloat16", num_microbatches=2)
    measured = dist_pool.run(fsdp_copied_bytes, 2, case)
    cfg = GalaxyConfig.from_dict(dict(MODEL, **dict(TRAIN, **case)))
    work = Workload(cfg.model, "train", TRAIN["global_batch_size"], TRAIN["seq_length"], "bfloat16",
                    mp_grad_reduce="fsdp")
    layout = Layout(microbatches=2)
    params, _, _, replicated = memory.stage_parameters(
        work, (TP, SP, SP), workload.Splits.balanced(cfg.model, TRAIN["seq_length"], 2), layout, 2)
    u, = memory.FsdpUnits.of(work, layout, 0, params[0], replicated[0])
    assert u.edge == 0 and u.groups == ((0, 1), (0, 1))
    predicted = float(sum(u.layers * simulate.fsdp_copy_bytes(u.per_layer[:, 0], 2, 4, 2, 2, k, 2, False)
                          for k in range(2))[0])
    for copied, other in measured:
        assert not other, other
        assert sum(copied.values()) == predicted, sorted(copied.items())


def test_mp_fsdp_traffic_waits_for_a_gather_and_a_reduce_scatter_per_micro_batch():
    """Galaxy2 at mp 2 with ``mp_grad_reduce: fsdp`` against ``after_backward``: on a link fast against the
    compute FSDP's gathers and reduce-scatters of the MLP hide but for the first layer's gather and the
    last reduce-scatter of each micro-batch, and the after-backward sum covers only what FSDP does not
    shard (embeddings and head, norm scales); on a slow link the step takes at least the whole traffic;
    memory: the MLP's states as 1/mp blocks, two layers' MLP weights gathered at a time."""
    from galaxy.config import PLAN_PRESETS

    model = dict(LLAMA, num_hidden_layers=4)
    layout, M, layers = Layout(microbatches=2), 2, 4
    methods = PLAN_PRESETS["galaxy2"]
    after = Workload(model_config_of(model), "train", 8, 8, mp_grad_reduce="after_backward")
    fsdp = dataclasses.replace(after, mp_grad_reduce="fsdp")
    split = workload.Splits.balanced(after.model, 8, 2)

    def step(work, alpha, beta):
        cluster = synthetic_cluster(model, 2, [1.0, 1.0], alpha=alpha, beta=beta)
        return cluster, predict(cluster, work, methods, split, layout)

    fast = synthetic_cluster(model, 2, [1.0, 1.0], alpha=1e-9, beta=1e-15)
    ab = fast.collective([0, 1], "all_gather")  # one alpha-beta for every op of the synthetic cluster

    def bucketed(nbytes):
        n = max(int(np.ceil(nbytes / simulate.GRAD_BUCKET_BYTES)), 1)
        return n * ab(nbytes / n)
    replicated = memory.stage_parameters(fsdp, methods, split, layout, 2)[3][0][0, 0]
    summed = {w.mp_grad_reduce: memory.stage_parameters(w, methods, split, layout, 2)[1][0][0, 0]
              for w in (after, fsdp)}
    assert summed["after_backward"] - summed["fsdp"] == replicated > 0
    n = replicated / layers
    time = {w.mp_grad_reduce: float(step(w, 1e-9, 1e-15)[1].time_s[0] - step(w, 0.0, 0.0)[1].time_s[0])
            for w in (after, fsdp)}
    waited = M * (ab(n * 4) + ab(n * 4))  # float32: gathered and reduced in 4 bytes
    assert time["fsdp"] - time["after_backward"] == pytest.approx(
        waited - bucketed(summed["after_backward"] * 4) + bucketed(summed["fsdp"] * 4), rel=1e-6)
    slow, pred = step(fsdp, 1e-3, 1e-6)
    ab = slow.collective([0, 1], "all_gather")
    assert pred.time_s[0] >= M * layers * (2 * ab(n * 4) + ab(n * 4))
    held = step(after, 0.0, 0.0)[1].memory_bytes[0, 0] - step(fsdp, 0.0, 0.0)[1].memory_bytes[0, 0]
    assert held == pytest.approx(replicated * 16 / 2 - 2 * n * 4, rel=1e-12)  # 16 bytes a float32 weight's states


def step_comm_bytes(ctx, case):
    """Bytes this rank's communicators (FSDP's included) recorded over one training step of ``case``."""
    from galaxy.train.loop import Trainer
    from tests.core.test_dp_pp import build

    cfg, _, model, _, batch_at = build(ctx, case)
    trainer = Trainer(model, cfg, ctx)
    before = trainer.comm_bytes()
    trainer.optimizer_step(trainer.forward_backward(trainer.read_batch(batch_at, 0)), 1)
    trainer.grad_sync.remove()
    return trainer.comm_bytes() - before


@pytest.mark.parametrize("reshard", ["default", "never"])
def test_mp_fsdp_step_bytes_are_what_the_run_records(dist_pool, reshard):
    """What ``mp_grad_reduce: fsdp`` changes in a step's bytes against ``after_backward`` (galaxy2's MLP
    over mp 2, 2 micro-batches, float64): the MLP's weights gathered every micro-batch (twice where
    resharded) and their gradients reduce-scattered, where after_backward all-reduced them once; the
    cost model's ``comm_bytes`` moves by what global rank 0's communicators record."""
    from galaxy.config import PLAN_PRESETS
    from tests.core.test_dp_pp import LLAMA as MODEL, TRAIN

    case = dict(model="llama", plan="galaxy2", num_microbatches=2)
    modes = {"after_backward": {}, "fsdp": dict(mp_grad_reduce="fsdp", reshard_after_forward=reshard)}
    measured = {m: dist_pool.run(step_comm_bytes, 2, dict(case, **extra))[0] for m, extra in modes.items()}
    cfg = GalaxyConfig.from_dict(dict(MODEL, **TRAIN))
    cluster = synthetic_cluster(dict(MODEL), 2, [1.0, 1.0], seq=TRAIN["seq_length"], rows=TRAIN["global_batch_size"])
    predicted = {}
    for mode, extra in modes.items():
        work = Workload(cfg.model, "train", TRAIN["global_batch_size"], TRAIN["seq_length"], "float64",
                        mp_grad_reduce=mode, reshard_after_forward=extra.get("reshard_after_forward", "default"))
        pred = predict(cluster, work, PLAN_PRESETS["galaxy2"],
                       workload.Splits.balanced(cfg.model, TRAIN["seq_length"], 2), Layout(microbatches=2))
        predicted[mode] = float(pred.detail["comm_bytes"][0])
    assert measured["fsdp"] != measured["after_backward"]
    assert predicted["fsdp"] - predicted["after_backward"] == measured["fsdp"] - measured["after_backward"]
