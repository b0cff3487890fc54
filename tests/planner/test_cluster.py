"""galaxy.planner.cluster: alpha-beta fits (from synthetic timings with known terms), piece curves and their
rows, a rank's sustained scale, restricted profiles, and the cluster file (round trip, one-line errors)."""

import dataclasses
import json

import numpy as np
import pytest

from galaxy.config import ConfigError
from galaxy.planner.cluster import (AlphaBeta, Curve, Piece, RankProfile, candidate_groups, cluster_from_dict,
                                    isotonic, load_cluster)
from galaxy.planner.profile import model_params
from galaxy.planner.search import search
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Splits, Workload
from tests.planner.helpers import BERT, LLAMA, NONE, synthetic_cluster


def test_alpha_beta_fit_recovers_known_terms():
    rng = np.random.default_rng(0)
    alpha, beta = 3e-4, 2.5e-9
    sizes = [4096 * 4**k for k in range(7)]
    samples = [(n, (alpha + beta * n) * (1 + 0.01 * rng.standard_normal())) for n in sizes]
    fit = AlphaBeta.fit(samples)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.02)
    # a line through the origin never gets a negative latency
    assert AlphaBeta.fit([(100, 1e-6), (200, 2.2e-6), (400, 4.1e-6)]).alpha_s >= 0.0
    # measured sizes predict themselves; a line's own samples predict the line anywhere
    assert fit(sizes) == pytest.approx(isotonic([t for _, t in samples]), rel=1e-12)
    exact = AlphaBeta.fit([(n, alpha + beta * n) for n in sizes])
    probe = np.array([0, 1000, 50_000, 10**6, 10**9])
    assert exact(probe) == pytest.approx(alpha + beta * probe, rel=1e-6)


def test_collective_time_follows_its_measured_curve():
    """A token-bucket link: the first 64 KiB pass at line rate, the rest at the shaped rate. Between
    measured sizes the time is linear, beyond the largest it keeps the last slope."""
    burst, fast, slow = 65536, 1e-9, 8e-8
    t = lambda n: 1e-4 + fast * min(n, burst) + slow * max(n - burst, 0)  # noqa: E731
    sizes = [4096 * 4**k for k in range(6)]
    ab = AlphaBeta.fit([(n, t(n)) for n in sizes])
    assert ab(sizes) == pytest.approx([t(n) for n in sizes], rel=1e-12)
    assert ab(600_000) == pytest.approx(t(600_000), rel=1e-12)  # linear beyond the knee
    assert ab(sizes[-1] * 3) == pytest.approx(t(sizes[-1] * 3), rel=1e-12)
    assert ab.scaled_bytes(2.0)(sizes[-1] / 2) == pytest.approx(t(sizes[-1]), rel=1e-12)


def test_sustained_scale_stretches_training_compute_only():
    """A rank whose serial steps ran slower back to back (``sustained_scale``, a GPU at its power
    limit): every training prediction's compute is that much longer, the optimizer and the step
    overhead as they were, a batch-1 forward (a latency, no sustained load) unchanged."""
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 0.5])
    m, seq, rows = cluster.model, cluster.seq_length, cluster.rows[0]
    rank = dataclasses.replace(cluster.ranks[1], rank=0, step_overhead_s=0.01)
    burst, held = (dataclasses.replace(cluster.restrict([1]), ranks=(dataclasses.replace(rank, sustained_scale=s),))
                   for s in (1.0, 1.25))
    serial, none = Splits.balanced(m, seq, 1), (NONE, NONE, NONE)
    train, latency = Workload(m, "train", rows, seq), Workload(m, "latency", rows, seq)
    fixed = float(rank.optimizer(model_params(m))) + rank.step_overhead_s
    t_burst, t_held = (predict(c, train, none, serial).time_s[0] for c in (burst, held))
    assert t_held - fixed == pytest.approx(1.25 * (t_burst - fixed), rel=1e-9)
    assert predict(held, latency, none, serial).time_s[0] == predict(burst, latency, none, serial).time_s[0]


def test_curve_is_monotone_and_robust_to_one_outlier():
    c = Curve((1, 2, 3, 4), (1.0, 9.0, 3.0, 4.0))  # one slow outlier at 2
    ys = c(np.array([1, 2, 3, 4, 6]))
    assert (np.diff(ys) >= 0).all()
    assert ys[-2] < 9.0  # isotonic fit, not a running maximum
    assert isotonic([3, 1, 2]).tolist() == [2, 2, 2]


def test_piece_is_linear_in_rows_between_measured_batch_sizes():
    def piece(scale):
        return Piece(Curve((1, 2), (1.0 * scale, 2.0 * scale)), Curve((1, 2), (3.0 * scale, 4.0 * scale)),
                     Curve((1, 2), (10.0 * scale, 20.0 * scale)))

    two = RankProfile(0, "h", 1, {1: {"mlp.ffn": piece(1.0)}, 3: {"mlp.ffn": piece(5.0)}}, AlphaBeta(0, 0))
    fwd, bwd, act = two.piece("mlp.ffn", 2, np.array([2]))
    assert (fwd[0], bwd[0], act[0]) == (6.0, 12.0, 60.0)  # halfway between rows 1 and 3
    assert two.piece("mlp.ffn", 5, np.array([1]))[0][0] == 9.0  # beyond: the same line (1 + 4 x 2)
    one = RankProfile(0, "h", 1, {4: {"mlp.ffn": piece(1.0)}}, AlphaBeta(0, 0))
    assert one.piece("mlp.ffn", 2, np.array([2]))[0][0] == 1.0  # one batch size: proportional


def test_restricted_profile_renumbers_ranks_and_groups():
    cluster = synthetic_cluster(BERT, 3, [1.0, 2.0, 3.0])
    assert set(candidate_groups(3)) == {(0, 1, 2), (0, 1), (1, 2), (0, 2)}
    sub = cluster.restrict((0, 2))
    assert sub.world == 2 and [r.rank for r in sub.ranks] == [0, 1]
    assert sub.ranks[1].pieces is cluster.ranks[2].pieces
    assert sub.collective([0, 1], "all_reduce") is cluster.collective([0, 2], "all_reduce")
    older = dataclasses.replace(cluster, groups={g: v for g, v in cluster.groups.items() if g != (0, 2)})
    assert older.restrict((0, 2)) is None  # a profile without that pair: the subset is skipped
    assert {c.devices for c in search(older, Workload(cluster.model, "latency", 2, 8), ffn_unit=8, top=100)} \
        == {(0, 1, 2), (0, 1), (1, 2), (0,), (1,), (2,)}


def test_cluster_file_round_trip_and_errors(tmp_path):
    cluster = synthetic_cluster(BERT, 2, [1.0, 2.0], waited=0.5)
    path = tmp_path / "cluster.json"
    cluster.save(str(path))
    again = load_cluster(str(path))
    assert again.ranks[1].pieces[2]["mlp.ffn"].fwd == cluster.ranks[1].pieces[2]["mlp.ffn"].fwd
    assert again.collective([0, 1], "all_gather") == cluster.collective([0, 1], "all_gather")
    assert again.waiting_leave([0, 1], "all_gather") == cluster.waiting_leave([0, 1], "all_gather") \
        != cluster.collective([0, 1], "all_gather")

    def broken(edit):
        raw = json.loads(path.read_text())
        edit(raw)
        with pytest.raises(ConfigError) as e:
            cluster_from_dict(raw, "c.json")
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "'ranks[1].pieces.2.mlp.ffn.fwd_s'" in broken(lambda r: r["ranks"][1]["pieces"]["2"]["mlp.ffn"].update(fwd_s="x"))
    assert "'ranks[0].pieces.2.con.tokens'" in broken(lambda r: r["ranks"][0]["pieces"]["2"].pop("con.tokens"))
    assert "'ranks[0].pieces.2.head.tokens.sizes'" in broken(
        lambda r: r["ranks"][0]["pieces"]["2"]["head.tokens"].update(sizes=[4, 2, 8]))
    assert "'ranks[1].pieces.2'" in broken(lambda r: r["ranks"][1].update(pieces={"3": {}}))
    assert "'groups[0].ops.reduce_scatter.alpha_s'" in broken(
        lambda r: r["groups"][0]["ops"]["reduce_scatter"].update(alpha_s=-1))
    assert "'groups[0].early_leave.all_gather.beta_s_per_byte'" in broken(
        lambda r: r["groups"][0]["early_leave"]["all_gather"].pop("beta_s_per_byte"))
    raw = json.loads(path.read_text())
    raw["groups"][0].pop("early_leave")  # older files: every member leaves together
    older = cluster_from_dict(raw)
    assert older.waiting_leave([0, 1], "all_gather") == older.collective([0, 1], "all_gather")
    assert "'ranks'" in broken(lambda r: r["ranks"].pop())
    assert "'ranks[0].memory_bytes'" in broken(lambda r: r["ranks"][0].update(memory_bytes=0))
    assert "'ranks[1].step_overhead_s'" in broken(lambda r: r["ranks"][1].pop("step_overhead_s"))
    assert "'ranks[0].serial_steps_s'" in broken(lambda r: r["ranks"][0].update(serial_steps_s=[0.5, -1.0]))
    assert "'ranks[1].activation_scale'" in broken(lambda r: r["ranks"][1].update(activation_scale=1.5))
    assert "'ranks[0].serial_peak_bytes'" in broken(lambda r: r["ranks"][0].update(serial_peak_bytes=-3))
    assert "'ranks[1].sustained_scale'" in broken(lambda r: r["ranks"][1].update(sustained_scale=0.9))
    raw = json.loads(path.read_text())
    raw["ranks"][1].update(activation_scale=0.7, serial_peak_bytes=123, shallower_peak_bytes=100, sustained_scale=1.2)
    kept = cluster_from_dict(raw).ranks[1]
    assert (kept.activation_scale, kept.serial_peak_bytes, kept.shallower_peak_bytes, kept.sustained_scale) \
        == (0.7, 123, 100, 1.2)
    raw = json.loads(path.read_text())
    raw["ranks"][0].pop("serial_forwards_s")  # older files kept no serial runs
    raw["ranks"][0].pop("activation_scale")  # nor an activation scale
    raw["ranks"][0].pop("sustained_scale")  # nor a sustained one
    older = cluster_from_dict(raw).ranks[0]
    assert (older.serial_forwards_s, older.activation_scale, older.sustained_scale) == ((), 1.0, 1.0)
    assert "'model'" in broken(lambda r: r["model"].update(hidden_sise=3))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_cluster(str(path))
