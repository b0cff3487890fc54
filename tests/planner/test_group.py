"""galaxy.planner.group: one group's collectives and their timing. Its transitions' bytes are derived by
hand, and every activation collective it charges is one the real model issues on Gloo (the Communicator's
records); the last member of a collective leaves after the ones that waited."""

import numpy as np
import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.planner.group import GroupModel, collectives
from galaxy.planner.workload import Splits, Workload
from tests.planner.helpers import BERT, LLAMA, NONE, PLANS, SP, TP, synthetic_cluster


def test_transition_bytes_hand_derived():
    """rows=2, seq=8, hidden=32, fp32: a full activation is 2*8*32*4 = 2048 bytes; an uneven
    [5, 3] sequence split is padded to 2 x 5 rows on the wire (2560 bytes)."""
    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0])
    work = Workload(cluster.model, "train", 2, 8)
    split = Splits.one([2, 2], [32, 32], [5, 3])
    g = GroupModel(cluster, work, (TP, SP, TP), split, [0, 1], rows=2)
    enter = g.transition("S", "T", "enter")  # all-gather / reduce-scatter
    assert (enter.fwd_op, enter.bwd_op, enter.nbytes, float(enter.wire[0])) == \
        ("all_gather", "reduce_scatter", 2048, 2560.0)
    leave = g.transition("P", "S", "leave")
    assert (leave.fwd_op, leave.bwd_op) == ("reduce_scatter", "all_gather")
    g_tp = GroupModel(cluster, work, (TP, NONE, TP), split, [0, 1], rows=2)
    assert g_tp.transition("R", "T", "").fwd_op is None and g_tp.transition("R", "T", "").bwd_op == "all_reduce"
    ar = g_tp.transition("P", "R", "")
    assert (ar.fwd_op, ar.bwd_op, ar.nbytes, float(ar.wire[0])) == ("all_reduce", None, 2048, 2048.0)
    assert g_tp.transition("R", "R", "") is None and g.transition("S", "S", "") is None
    # Galaxy per layer: AG, RS around ATT and around MLP, forward and backward: 8 collectives
    ops = collectives(g, layers=1)
    assert [op for op, _, _ in ops[:4]] == ["all_gather", "reduce_scatter"] * 2
    assert len([o for o in ops if o[0] != "all_reduce"]) == 8


def record_collectives(ctx, config, seed):
    from galaxy.models import build_model

    cfg = GalaxyConfig.from_dict(config)
    plan = cfg.resolve_plan(ctx.mp.size)
    model = build_model(cfg, plan, ctx)
    records = []
    ctx.mp.observers.append(records.append)
    try:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_length),
                            generator=gen)
        model(ids, labels=ids.clone()).loss.backward()
    finally:
        ctx.mp.observers.remove(records.append)
    return [(r.op, r.nbytes, r.phase) for r in records]


# The SP attention flavours' own exchanges: the ring's point-to-point blocks (LLaMA's in the zigzag order) and
# dK/dV accumulators, Ulysses' all-to-alls (heads [3, 5]: a GQA group of 4 split over both ranks).
SP_ATTENTION_PLANS = [(model_type, methods, heads, ffn, seq, flavour) for flavour in ("ring", "ulysses")
                      for model_type, methods, heads, ffn, seq in [("llama", (SP, SP, SP), [3, 5], [24, 24], [10, 6]),
                                                                   ("llama", (SP, SP, TP), [4, 4], [20, 28], [7, 9]),
                                                                   ("llama", (SP, NONE, TP), [2, 6], [24, 24], [8, 8]),
                                                                   ("bert", (SP, SP, SP), [1, 3], [32, 32], [11, 5])]]


@pytest.mark.parametrize("model_type,methods,heads,ffn,seq,sp_attention",
                         [p + ("allgather",) for p in PLANS] + SP_ATTENTION_PLANS)
def test_predicted_collectives_match_the_model(dist_pool, model_type, methods, heads, ffn, seq, sp_attention):
    """Every activation collective the cost model charges is one the real model issues, same op,
    same bytes, same phase (forward or backward), and nothing else is issued."""
    raw = BERT if model_type == "bert" else LLAMA
    names = ("att_parallel_method", "con_parallel_method", "mlp_parallel_method")
    config = {"model": raw, "train": {"seq_length": 16, "global_batch_size": 2},
              "parallel": {**{k: m.value for k, m in zip(names, methods)}, "tp_num_attention_heads_list": heads,
                           "tp_intermediate_size_list": ffn, "seq_scatter_list": seq, "sp_attention": sp_attention}}
    real = dist_pool.run(record_collectives, 2, config, 0)[0]
    cluster = synthetic_cluster(raw, 2, [1.0, 1.0], seq=16)
    work = Workload(cluster.model, "train", 2, 16, sp_attention=sp_attention)
    g = GroupModel(cluster, work, methods, Splits.one(heads, ffn, seq), [0, 1], rows=2)
    predicted = collectives(g, cluster.model.num_hidden_layers)
    assert sorted(predicted) == sorted(real)
    assert [p for p in predicted if p[2] == "fwd"] == [r for r in real if r[2] == "fwd"]


def test_the_last_member_leaves_a_collective_after_the_ones_that_waited():
    """Hand-derived: all-gathers of 10 ms for the last member to arrive and 4 ms for the one that
    waited. Rank 1 arrives last at 3 s and leaves at 3.010, rank 0 at 3.004; then rank 0 computes 2 s
    (5.004) and rank 1 0.5 s (3.510), so rank 0 is last: 5.014, rank 1 leaves at 5.008. A file
    without the waiting time has both leave together (3.010, then 5.010 + 0.010). The segments keep
    each rank's compute, and their sum of maxima plus the 4 ms stays below the time."""
    from galaxy.planner.group import Collective, Compute, Segments, run

    def model(waited):
        cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], alpha=0.010, beta=0.0, waited=waited)
        work = Workload(cluster.model, "latency", 1, 8)
        return GroupModel(cluster, work, (SP, SP, SP), Splits.balanced(cluster.model, 8, 2), [0, 1], 1)

    def step(*fwd):
        return Compute(np.array([fwd]), np.zeros((1, 2)), np.zeros((1, 2)))

    gather = Collective("all_gather", None, 64, np.array([64.0]))
    events = [step(1.0, 3.0), gather, step(2.0, 0.5), gather]
    g = model(0.4)
    g.segments = Segments()
    np.testing.assert_allclose(run(g, events, np.zeros((1, 2))), [[5.014, 5.008]], rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(g.segments.parts), [[1.0, 3.0], [2.0, 0.5]], atol=1e-12)
    assert sum(p.max() for p in g.segments.parts) + sum(c.sum() for c in g.segments.comm) == pytest.approx(5.008)
    np.testing.assert_allclose(run(model(None), events, np.zeros((1, 2))), [[5.02, 5.02]], rtol=0, atol=1e-12)
    # arriving together, one of them is still last
    assert sorted(run(model(0.4), [gather], np.full((1, 2), 2.0))[0]) == pytest.approx([2.004, 2.010])
