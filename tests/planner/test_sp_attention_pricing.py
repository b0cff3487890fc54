"""The planner prices the SP attention flavours (``sp_attention``: allgather, ring, ulysses) and chooses.

References: the collectives the cost model charges for each flavour are the ones the real model records
(tests/planner/test_group.py, ``SP_ATTENTION_PLANS``); a step's bytes hold them; the bounds hold against predictions of sampled
splits; the search's choice is the flavour the simulator itself prices fastest, on made-up clusters where
each flavour should win: ring attention where long causal sequences give the attention compute that hides
its transfers (a slow link, few kv heads), Ulysses where the link is the cost and K/V are as large as Q (no
GQA), the K/V all-gather where short messages make every extra step's latency count."""

import numpy as np
import pytest

from galaxy.config import GalaxyConfig, Method
from galaxy.planner.blocks import grid
from galaxy.planner.bounds import might_fit
from galaxy.planner.cluster import (OPS, PIECES, AlphaBeta, ClusterProfile, Curve, Piece, RankProfile,
                                    candidate_groups, cluster_from_dict)
from galaxy.planner.group import GroupModel, collectives
from galaxy.planner.search import SplitSearch, search
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Layout, Splits, Workload
from tests.planner.helpers import LLAMA, synthetic_cluster
from tests.planner.test_search_bounds import every_layout, sampled_splits

TP, SP, NONE = Method.TP, Method.SP, Method.NONE
FLAVOURS = ("allgather", "ring", "ulysses")

def test_step_bytes_count_the_flavours_exchanges():
    """``comm_bytes`` (global rank 0's bytes of a step) holds every record ``collectives`` lists, the step's
    own reductions aside: the same difference from allgather's as between their collectives' sums."""
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 1.0], seq=16)
    split = Splits.one([3, 5], [24, 24], [10, 6])
    sent, listed = {}, {}
    for flavour in FLAVOURS:
        work = Workload(cluster.model, "train", 2, 16, sp_attention=flavour)
        sent[flavour] = float(predict(cluster, work, (SP, SP, SP), split, Layout()).detail["comm_bytes"][0])
        g = GroupModel(cluster, work, (SP, SP, SP), split, [0, 1], rows=2)
        listed[flavour] = sum(n for _, n, _ in collectives(g, cluster.model.num_hidden_layers))
    for flavour in ("ring", "ulysses"):
        assert sent[flavour] - sent["allgather"] == listed[flavour] - listed["allgather"] != 0


@pytest.mark.parametrize("speeds,beta", [([1.0, 2.5], 1e-9), ([3.0, 1.0, 1.0, 2.0], 1e-9), ([1e3, 1e3, 2e3], 1e-6)])
def test_bounds_hold_for_the_flavours(speeds, beta):
    """No sampled split of a layout whose ATT is SP is predicted faster than the bound (the ring counted as its
    compute alone, Ulysses' all-to-alls at the least bytes any split sends), nor fits where none may."""
    rng = np.random.default_rng(len(speeds))
    cluster = synthetic_cluster(dict(LLAMA, num_hidden_layers=4), len(speeds), speeds, alpha=5e-5, beta=beta,
                                memory=2**19)
    checked = 0
    for flavour in ("ring", "ulysses"):
        for objective in ("train", "latency"):
            work = Workload(cluster.model, objective, 8, 8, "bfloat16", sp_attention=flavour)
            for s in every_layout(cluster, work):
                if s.methods[0] != SP or s.mp == 1:
                    continue
                pred = predict(cluster, work, s.methods, s.splits(sampled_splits(s, rng)), s.layout)
                assert s.lower_bound() <= pred.time_s.min() * (1 + 1e-12), (flavour, s.methods, s.layout)
                if not might_fit(cluster, work, s.methods, s.layout, s.units, s.uses):
                    assert not pred.fits.any(), (flavour, s.methods, s.layout)
                checked += 1
    assert checked > 0


# ----------------------------------------------------------------------------- choosing


def made_up_cluster(model_raw: dict, world: int, seq: int, core_s: float, alpha: float, beta: float) -> ClusterProfile:
    """Equal ranks whose pieces are linear in their size: the attention core ``core_s`` seconds forward over the
    whole sequence (the per-head core of a causal model half that: flash attention skips the masked half of a
    square), the other pieces small beside it; every collective ``alpha + beta * bytes``."""
    m = GalaxyConfig.from_dict({"model": model_raw, "train": {"seq_length": seq}}).model
    full = {"heads": m.num_attention_heads, "tokens": seq, "ffn": m.intermediate_size}
    sizes = {by: grid(n) for by, n in full.items()}
    share = {"att_proj": 0.05, "mlp": 0.2, "con": 0.01, "head": 0.1, "att_core": 1.0}
    ranks = []
    for r in range(world):
        pieces = {}
        for name in PIECES:
            kind, by = name.split(".")
            seconds = core_s * share[kind] * (0.5 if name == "att_core.heads" else 1.0)
            fwd = tuple(seconds * x / full[by] for x in sizes[by])
            pieces[name] = Piece(Curve(tuple(sizes[by]), fwd), Curve(tuple(sizes[by]), tuple(2 * v for v in fwd)),
                                 Curve(tuple(sizes[by]), tuple(1000.0 * x for x in sizes[by])))
        ranks.append(RankProfile(r, "host", 2**40, {1: pieces}, AlphaBeta(1e-4, 1e-12)))
    groups = {g: {op: AlphaBeta(alpha, beta) for op in OPS} for g in candidate_groups(world)}
    return ClusterProfile(world, "nccl", "cuda", m, (1,), seq, "bfloat16", tuple(ranks), groups)


LONG = dict(model_type="llama", vocab_size=1024, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, intermediate_size=4096, hidden_act="silu", pad_token_id=None,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32768)
SCENARIOS = {  # model, sequence, the attention core's seconds, link latency and seconds per byte; the winner
    "long causal sequence, GQA, slow link": (LONG, 32768, 0.5, 1e-5, 1 / 2e9, "ring"),
    "long sequence, no GQA, little compute": (dict(LONG, num_key_value_heads=32), 32768, 0.01, 1e-5, 1 / 10e9,
                                              "ulysses"),
    "short sequence, latency-bound link": (LONG, 512, 1e-4, 2e-3, 1 / 50e9, "allgather"),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_search_chooses_the_flavour_the_simulator_prices_fastest(scenario):
    raw, seq, core_s, alpha, beta, winner = SCENARIOS[scenario]
    world = 4
    cluster = made_up_cluster(raw, world, seq, core_s, alpha, beta)
    split = Splits.balanced(cluster.model, seq, world)
    priced = {f: float(predict(cluster, Workload(cluster.model, "train", 1, seq, "bfloat16", sp_attention=f),
                               (SP, SP, SP), split, Layout()).time_s[0]) for f in FLAVOURS}
    assert min(priced, key=priced.get) == winner, priced
    work = Workload(cluster.model, "train", 1, seq, "bfloat16")
    plans = search(cluster, work, ffn_unit=512, seq_unit=seq // 8, top=1000, prune=False, sp_attentions=FLAVOURS)
    sp = [c for c in plans if c.methods == (SP, SP, SP) and len(c.devices) == world and c.layout == Layout()]
    assert {c.sp_attention for c in sp} == set(FLAVOURS)
    best = min(sp, key=lambda c: c.time_s)
    assert best.sp_attention == winner
    # and at its own splits no other flavour is faster
    own = Splits.one(best.heads, best.ffn, best.seq)
    for f in FLAVOURS:
        other = predict(cluster, Workload(cluster.model, "train", 1, seq, "bfloat16", sp_attention=f), (SP, SP, SP),
                        own, Layout()).time_s[0]
        assert best.time_s <= other * (1 + 1e-12), (f, other, best.time_s)


def test_the_ring_hides_its_transfers_behind_the_attention_and_ulysses_splits_the_heads():
    """Per layer, forward: allgather pays its gather and the core one after the other; the ring the larger of
    each step's share of the core and a block's transfer; Ulysses searches the head split (GQA groups may
    straddle ranks), the other flavours do not use it."""
    raw, seq = LONG, 32768
    cluster = made_up_cluster(raw, 4, seq, 0.5, 1e-5, 1 / 2e9)
    ring = SplitSearch(cluster, Workload(cluster.model, "train", 1, seq, "bfloat16", sp_attention="ring"),
                       (SP, SP, SP), Layout())
    ulysses = SplitSearch(cluster, Workload(cluster.model, "train", 1, seq, "bfloat16", sp_attention="ulysses"),
                          (SP, SP, SP), Layout())
    assert ring.uses == ("seq",) and ulysses.uses == ("heads", "seq") and ulysses.units["heads"] == (1, 32)
    g = GroupModel(cluster, ring.work, (SP, SP, SP), Splits.balanced(cluster.model, seq, 4), [0, 1, 2, 3], 1)
    (core,) = [e for e in g.layer() if e.name == "ring attention"]
    link = cluster.collective([0, 1, 2, 3], "send_recv")
    block = float(link(core.kv.max()))
    step = float(core.fwd.max()) / 4
    assert float(core.seconds(g, backward=False)[0]) == pytest.approx(3 * max(step, block) + step, rel=1e-12)
    causal_share = (seq + 1) / (2 * seq)  # the zigzag steps skip the blocks the causal mask hides
    assert float(core.fwd[0, 0]) == pytest.approx(0.5 * (seq // 4) / seq * causal_share, rel=1e-9)


def test_cluster_files_without_the_flavours_collectives_derive_them():
    """A file from before all-to-all and the ring shift were measured: derived from the group's all-gather (an
    all-to-all of B bytes as an all-gather of B; a ring shift of B as an all-gather of N/(N-1) x B)."""
    cluster = synthetic_cluster(LLAMA, 3, [1.0, 1.0, 1.0], alpha=1e-4, beta=2e-9)
    raw = cluster.to_dict()
    for group in raw["groups"]:
        for key in ("ops", "early_leave"):
            for op in ("all_to_all", "send_recv"):
                group.get(key, {}).pop(op, None)
    old = cluster_from_dict(raw, "old")
    gather = old.collective([0, 1, 2], "all_gather")
    assert old.collective([0, 1, 2], "all_to_all") == gather
    shift = old.collective([0, 1, 2], "send_recv")
    assert float(shift(3000.0)) == pytest.approx(float(gather(4500.0)), rel=1e-12)
    assert float(old.collective([0, 2], "send_recv")(3000.0)) == pytest.approx(
        float(old.collective([0, 2], "all_gather")(6000.0)), rel=1e-12)
    assert cluster_from_dict(cluster.to_dict(), "new").to_dict() == cluster.to_dict()


def test_written_plan_names_its_flavour(tmp_path):
    from galaxy.cli.plan import plan_config

    raw, seq, core_s, alpha, beta, _ = SCENARIOS["long causal sequence, GQA, slow link"]
    cluster = made_up_cluster(raw, 4, seq, core_s, alpha, beta)
    cfg = GalaxyConfig.from_dict({"model": raw, "train": {"seq_length": seq, "global_batch_size": 1}})
    work = Workload(cluster.model, "train", 1, seq, "bfloat16")
    plans = search(cluster, work, ffn_unit=512, seq_unit=seq // 8, top=200, sp_attentions=FLAVOURS)
    for choice in plans:
        config = plan_config(cfg, choice, cluster.world)
        written = GalaxyConfig.from_dict(config)
        plan = written.resolve_plan(len(choice.devices) // (choice.layout.dp * choice.layout.pp))
        assert plan.sp_attention == choice.sp_attention
        if choice.sp_attention == "ulysses" and len(choice.seq) > 1:
            assert plan.heads_split == choice.heads
    assert {c.sp_attention for c in plans} == set(FLAVOURS)


@pytest.mark.parametrize("speeds,memory", [([1.0, 2.5, 1.3], 2**19), ([3.0, 1.0, 1.0, 2.0], 2**30)])
def test_pruned_search_over_the_flavours_returns_the_exhaustive_plans(speeds, memory):
    cluster = synthetic_cluster(dict(LLAMA, num_hidden_layers=4), len(speeds), speeds, alpha=5e-5, beta=1e-9,
                                memory=memory)
    work = Workload(cluster.model, "train", 8, 8)

    def key(c):
        return c.devices, c.methods, c.layout, c.heads, c.ffn, c.seq, c.sp_attention, round(c.time_s, 12), c.fits
    exhaustive = search(cluster, work, ffn_unit=8, top=3, prune=False, sp_attentions=FLAVOURS)
    pruned = search(cluster, work, ffn_unit=8, top=3, sp_attentions=FLAVOURS)
    assert [key(c) for c in pruned] == [key(c) for c in exhaustive]
