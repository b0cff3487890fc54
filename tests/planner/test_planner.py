"""The planner: cluster files, the cost model's pieces, the split search, the written config.

References: byte counts and parameter counts come from the real models running on Gloo (the
Communicator's records, the parameters' gradient rules); search optima from brute force over every
split scored by the same cost model; alpha-beta fits from synthetic timings with known terms.
"""

import dataclasses
import itertools
import json
import math
import statistics

import numpy as np
import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig, Method
from galaxy.planner.cluster import (OPS, PIECES, AlphaBeta, ClusterProfile, Curve, Piece, RankProfile,
                                    cluster_from_dict, isotonic, load_cluster)
from galaxy.planner.group import GroupModel, Segments, collectives
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Layout, Splits, Workload
from galaxy.planner.blocks import BlockBench, grid, off_the_line, time_pieces
from galaxy.planner.cluster import candidate_groups
from galaxy.planner.search import SplitSearch, compositions, min_max_split, search
from galaxy.planner.profile import model_params
from galaxy.planner.workload import edge_params, layer_params
from tests.core.test_comm_bytes import CASES as COMM_BYTES_CASES
from tests import REPO  # noqa: E402

TP, SP, NONE = Method.TP, Method.SP, Method.NONE

BERT = {"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 128, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 48, "hidden_act": "silu", "pad_token_id": None,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 128}


def model_config(raw):
    seq = raw.get("max_position_embeddings", 128)
    return GalaxyConfig.from_dict({"model": raw, "train": {"seq_length": seq}}).model


def synthetic_cluster(model_raw, world, speeds, seq=8, rows=2, alpha=2e-4, beta=1e-8, memory=2**30, waited=None):
    """Per-rank piece times linear in size, divided by the rank's speed; one alpha-beta for all groups.
    ``waited``: the members that waited leave an all-gather at that fraction of its time (as over Gloo)."""
    m = model_config(model_raw)
    sizes = {"heads": grid(m.num_attention_heads, m.num_attention_heads // m.kv_heads),
             "tokens": grid(seq), "ffn": grid(m.intermediate_size)}
    cost = {"att_proj": 3e-4, "att_core": 5e-4, "mlp": 8e-4, "con": 1e-4, "head": 6e-4}
    full = {"heads": m.num_attention_heads, "tokens": seq, "ffn": m.intermediate_size}
    ranks = []
    for r, speed in enumerate(speeds):
        pieces = {}
        for name in PIECES:
            kind, by = name.split(".")
            xs = tuple(sizes[by])
            fwd = tuple((2e-5 + cost[kind] * x / full[by]) / speed for x in xs)
            pieces[name] = Piece(Curve(xs, fwd), Curve(xs, tuple(2 * v for v in fwd)),
                                 Curve(xs, tuple(1000.0 * x for x in xs)))
        ranks.append(RankProfile(r, "host", memory, {rows: pieces}, AlphaBeta(1e-4, 1e-9 / speed)))
    groups = {g: {op: AlphaBeta(alpha, beta) for op in OPS} for g in candidate_groups(world)}
    early = {} if waited is None else {g: {**ops, "all_gather": AlphaBeta(alpha * waited, beta * waited)}
                                       for g, ops in groups.items()}
    return ClusterProfile(world, "gloo", "cpu", m, (rows,), seq, "float32", tuple(ranks), groups, early)


# ----------------------------------------------------------------------------- cost model pieces


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


@pytest.mark.parametrize("slower", [1.3, 0.8])
def test_calibration_predicts_the_serial_runs_it_was_given(slower):
    """A rank whose real serial step and forward took ``slower`` times the pieces' prediction: longer
    runs become overheads, shorter ones scale the pieces' compute (the optimizer stays as measured),
    and either way the serial plan on that rank is then predicted as measured, while a split plan
    moves with it in the same direction."""
    from galaxy.planner.profile import calibrated, model_params

    cluster = synthetic_cluster(LLAMA, 2, [1.0, 0.5])
    m, seq, rows = cluster.model, cluster.seq_length, cluster.rows[0]
    serial, none = Splits.balanced(m, seq, 1), (NONE, NONE, NONE)
    alone = cluster.restrict([1])
    train, latency = Workload(m, "train", rows, seq), Workload(m, "latency", rows, seq)
    step = predict(alone, train, none, serial).time_s[0]
    forward = predict(alone, latency, none, serial).time_s[0]
    optimizer = float(alone.ranks[0].optimizer(model_params(m)))
    measured_step = optimizer + (step - optimizer) * slower
    rank = calibrated(cluster.ranks[1], m, rows, seq, "float32", [measured_step], [forward * slower])
    assert (rank.step_compute_scale, rank.forward_compute_scale) == ((1.0, 1.0) if slower > 1 else (slower,) * 2)
    assert (rank.step_overhead_s > 0) == (slower > 1) and (rank.forward_overhead_s > 0) == (slower > 1)
    again = dataclasses.replace(alone, ranks=(dataclasses.replace(rank, rank=0),))
    assert predict(again, train, none, serial).time_s[0] == pytest.approx(measured_step, rel=1e-9)
    assert predict(again, latency, none, serial).time_s[0] == pytest.approx(forward * slower, rel=1e-9)
    both = dataclasses.replace(cluster, ranks=(cluster.ranks[0], rank))
    split = Splits.balanced(m, seq, 2)
    before, after = (predict(c, latency, (TP, SP, TP), split).time_s[0] for c in (cluster, both))
    assert (after > before) == (slower > 1)


@pytest.mark.parametrize("layer_share,edge_share", [(1.1, 0.85), (0.9, 1.2), (1.08, 1.0)])
def test_calibration_times_a_layer_by_the_difference_of_two_depths(layer_share, edge_share):
    """A GPU rank whose real layers took ``layer_share`` of their pieces' time and the rest of the step
    (embeddings, head, loss) ``edge_share`` of its pieces', seen in a serial step and the same step with one
    layer less: the layer pieces are scaled to the difference and the edges calibrated on what remains, so
    both depths are predicted as measured and so is a model of any depth, where a fit of the step as a whole
    puts the layers' error on the edges too and misses deeper models. Without the shallower step's times
    (a CPU profile) nothing changes."""
    from galaxy.planner.profile import calibrated

    cluster = synthetic_cluster({**LLAMA, "num_hidden_layers": 3}, 2, [1.0, 0.5])
    m, seq, rows = cluster.model, cluster.seq_length, cluster.rows[0]
    plain = cluster.ranks[1]

    def parts(rank, layers):
        """(predicted step, its optimizer part) of a serial model of ``layers`` layers on ``rank``."""
        model = dataclasses.replace(m, num_hidden_layers=layers)
        alone = dataclasses.replace(cluster.restrict([1]), model=model, ranks=(dataclasses.replace(rank, rank=0),))
        train = Workload(model, "train", rows, seq)
        step = predict(alone, train, (NONE,) * 3, Splits.balanced(model, seq, 1)).time_s[0]
        return step, float(rank.optimizer(model_params(model)))

    def real(layers):
        """What the rank measures: its optimizer, its layers and its edges at their shares of the pieces."""
        step, optimizer = parts(plain, layers)
        less, less_optimizer = parts(plain, layers - 1)
        layer = (step - optimizer) - (less - less_optimizer)
        return optimizer + layers * layer * layer_share + (step - optimizer - layers * layer) * edge_share

    deep = 9
    rank = calibrated(plain, m, rows, seq, "float32", [real(3)], [1.0], shallower_steps_s=[real(2)])
    assert rank.shallower_steps_s == (real(2),)
    for layers in (3, 2, deep):
        assert parts(rank, layers)[0] == pytest.approx(real(layers), rel=1e-9), layers
    whole = calibrated(plain, m, rows, seq, "float32", [real(3)], [1.0])  # one depth: the step as a whole
    assert whole.layer_compute_scale == 1.0 and parts(whole, 3)[0] == pytest.approx(real(3), rel=1e-9)
    assert parts(whole, deep)[0] != pytest.approx(real(deep), rel=1e-3)


@pytest.mark.parametrize("held_share", [0.6, 1.2])
def test_calibration_predicts_a_layers_peak_growth_it_was_given(held_share):
    """A rank whose serial step's peak grew by one layer's states and ``held_share`` of the activations
    its pieces saved for that layer (the step against the same with one layer less; a compiled layer keeps
    less than eager pieces): below 1 the saved bytes are scaled so that a layer's growth is predicted as
    measured, whatever the shallow model's embeddings and head hold besides (a constant added to both
    peaks changes nothing), and a split plan's memory moves with it; above 1, or one peak alone, nothing."""
    from galaxy.planner.profile import calibrated

    cluster = synthetic_cluster(LLAMA, 2, [1.0, 0.5], seq=64, rows=8)  # activations above the gradients
    m, seq, rows = cluster.model, cluster.seq_length, cluster.rows[0]
    shallower = dataclasses.replace(m, num_hidden_layers=m.num_hidden_layers - 1)
    none = (NONE, NONE, NONE)

    def memory(rank, model):
        alone = dataclasses.replace(cluster.restrict([1]), model=model, ranks=(dataclasses.replace(rank, rank=0),))
        train = Workload(model, "train", rows, seq)
        return predict(alone, train, none, Splits.balanced(model, seq, 1)).memory_bytes[0, 0]

    def growth(scale):
        rank = dataclasses.replace(cluster.ranks[1], activation_scale=scale)
        return memory(rank, m) - memory(rank, shallower)

    plain = cluster.ranks[1]
    held, saved = growth(1.0), 2 * (growth(1.0) - growth(0.5))  # (the peak's states do not scale)
    assert 0 < saved < held, "a layer saves activations and holds states"
    transient = 12345678  # what the shallow model's edges hold at its peak beyond the cost model's
    peak = int(memory(plain, m)) + transient
    shallower_peak = peak - int(held - (1 - held_share) * saved)
    step = predict(cluster.restrict([1]), Workload(m, "train", rows, seq), none, Splits.balanced(m, seq, 1)).time_s[0]
    rank = calibrated(plain, m, rows, seq, "float32", [step], [1.0], peak, shallower_peak)
    assert (rank.serial_peak_bytes, rank.shallower_peak_bytes) == (peak, shallower_peak)
    assert rank.activation_scale == (pytest.approx(held_share, rel=1e-6) if held_share < 1 else 1.0)
    assert memory(rank, m) - memory(rank, shallower) == pytest.approx(min(peak - shallower_peak, held), rel=1e-6)
    both = dataclasses.replace(cluster, ranks=(cluster.ranks[0], rank))
    split = Splits.balanced(m, seq, 2)
    train = Workload(m, "train", rows, seq)
    before, after = (predict(c, train, (TP, SP, TP), split).memory_bytes[0, 1] for c in (cluster, both))
    assert (after < before) == (held_share < 1)
    assert calibrated(plain, m, rows, seq, "float32", [step], [1.0]).activation_scale == 1.0  # no peak
    assert calibrated(plain, m, rows, seq, "float32", [step], [1.0], peak).activation_scale == 1.0  # one depth


def test_a_steps_first_micro_batch_peaks_without_gradients_and_the_later_ones_with_them():
    """The real Trainer: a step starts with no gradient (zero_grad sets them to None), so the end of its
    first micro-batch's forward, where the saved activations peak, holds none; every later micro-batch's
    forward holds the gradients accumulated so far. The cost model's peak of two micro-batches is one
    micro-batch's (the same rows) plus the master gradients (float32 here), where activations dominate."""
    from galaxy.core.context import ParallelContext
    from galaxy.config import Plan
    from galaxy.models import build_model
    from galaxy.train.loop import make_trainer

    seen = {}
    for micro in (1, 2):
        cfg = GalaxyConfig.from_dict({"model": dict(LLAMA), "train": {"global_batch_size": 4, "seq_length": 8},
                                      "parallel": {"num_microbatches": micro}})
        model = build_model(cfg, Plan.serial(cfg), ParallelContext.serial())
        trainer = make_trainer(model, cfg, ParallelContext.serial())
        params = [p for p in model.parameters() if p.requires_grad]
        ends = seen[micro] = []
        model.register_forward_hook(lambda *_: ends.append(any(p.grad is not None for p in params)))
        for step in range(2):
            ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
            trainer.optimizer_step(trainer.forward_backward({"input_ids": ids, "labels": ids}), step + 1)
    assert seen == {1: [False, False], 2: [False, True, False, True]}

    cluster = synthetic_cluster(LLAMA, 1, [1.0], seq=64, rows=8)
    m, none = cluster.model, (NONE, NONE, NONE)
    peak = {micro: predict(cluster, Workload(m, "train", 8 * micro, 64), none, Splits.balanced(m, 64, 1),
                           Layout(microbatches=micro)).memory_bytes[0, 0] for micro in (1, 2)}
    assert peak[2] - peak[1] == pytest.approx(4 * model_params(m), rel=1e-9)


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


def test_sustained_steps_scale_against_the_bursts():
    """``measure_sustained`` on the training loop's own serial steps (CPU, tiny LLaMA): as many steps as fill
    the seconds asked at the bursts' pace; bursts a thousand times as fast as the steps give a scale well above
    1, bursts a thousand times slower none (a sustained step is never taken as faster). (A thousand: a busy
    host stretches the steps, and a suite on two shared cores once ran the sustained steps twice as fast as the
    typical step timed before them.)"""
    from galaxy.planner.profile import measure_sustained, measure_serial

    model = GalaxyConfig.from_dict({"model": {"preset": "llama-tiny"}}).model
    cpu = torch.device("cpu")
    typical = statistics.median(measure_serial(model, 2, 16, "float32", cpu, 9, forwards=False)[0])
    scale, steps = measure_sustained(model, 2, 16, "float32", cpu, [typical / 1000] * 3, seconds=0.08 * typical)
    assert len(steps) in (80, 81) and scale > 10, (scale, typical)  # about 1000
    scale, steps = measure_sustained(model, 2, 16, "float32", cpu, [typical * 1000] * 3, seconds=40 * typical)
    assert len(steps) == 5 and scale == 1.0


def test_calibration_steps_compute_in_the_workload_dtype():
    """The serial steps that calibrate a bfloat16 profile run under the CLIs' autocast: every matmul
    of them in bfloat16 (they once ran in float32, and an H200's fp32 steps were read as 1 s of
    overhead on every plan)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from galaxy.planner.profile import measure_serial

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                self.seen.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    model = GalaxyConfig.from_dict({"model": {"preset": "llama-tiny"}}).model
    with MatmulDtypes() as matmuls:
        measure_serial(model, 2, 16, "bfloat16", torch.device("cpu"), reps=1)
    assert matmuls.seen == {torch.bfloat16}


def test_calibration_takes_an_overhead_from_the_fastest_run_only():
    """Serial runs with a burst of load in one of them: the overhead is what the fastest run took
    beyond the pieces (the burst is not charged to every plan); runs straddling the prediction
    (fastest below, median above) change nothing."""
    from galaxy.planner.profile import calibrated

    cluster = synthetic_cluster(LLAMA, 2, [1.0, 0.5])
    m, seq, rows = cluster.model, cluster.seq_length, cluster.rows[0]
    serial, none = Splits.balanced(m, seq, 1), (NONE, NONE, NONE)
    alone = cluster.restrict([1])
    step = predict(alone, Workload(m, "train", rows, seq), none, serial).time_s[0]
    forward = predict(alone, Workload(m, "latency", rows, seq), none, serial).time_s[0]
    rank = calibrated(cluster.ranks[1], m, rows, seq, "float32", [step * 1.1, step * 1.4, step * 1.1],
                      [forward * 1.05, forward * 1.05, forward * 3])
    assert rank.step_overhead_s == pytest.approx(step * 0.1, rel=1e-9)
    assert rank.forward_overhead_s == pytest.approx(forward * 0.05, rel=1e-9)
    assert (rank.step_compute_scale, rank.forward_compute_scale) == (1.0, 1.0)
    rank = calibrated(cluster.ranks[1], m, rows, seq, "float32", [step * 0.9, step * 1.2, step * 1.3],
                      [forward * 0.9, forward * 1.1, forward * 1.2])
    assert (rank.step_overhead_s, rank.forward_overhead_s, rank.step_compute_scale,
            rank.forward_compute_scale) == (0.0, 0.0, 1.0, 1.0)


def test_windowed_timing_shares_the_wall_time_by_the_parts():
    """A run whose parts report 1 ms and 3 ms but take 10 ms of wall time (the rest: time the rank
    was stopped, as under a CPU quota) is charged the wall time, split 1:3: at least the 10 ms it
    slept, at most the loop's wall time over the runs (a busy host may stretch both, never break them)."""
    import time

    from galaxy.planner.blocks import windowed

    runs = []

    def once():
        runs.append(1)
        time.sleep(0.01)
        return 0.001, 0.003

    start = time.perf_counter()
    fwd, bwd = windowed(once, 0.05)
    wall = time.perf_counter() - start
    assert bwd == pytest.approx(3 * fwd, rel=1e-9)
    assert 0.01 - 1e-9 <= fwd + bwd <= wall / len(runs), (fwd + bwd, wall, len(runs))
    assert windowed(once, 0.0) == (0.001, 0.003)


def test_off_the_line_flags_a_sample_its_neighbours_disagree_with():
    sizes = [1, 2, 4, 6, 8, 10, 12]
    line = [1.0 + 0.5 * x for x in sizes]
    assert off_the_line(sizes, line, 0.1) == []
    # the last: against the line through 4 and 6 extended; a neighbour of a bad one is flagged too
    assert off_the_line(sizes, [*line[:6], line[6] * 1.3], 0.1) == [5, 6]
    assert off_the_line(sizes, [line[0] * 1.3, *line[1:]], 0.1) == [0, 1]
    assert off_the_line(sizes, [*line[:3], line[3] * 1.3, *line[4:]], 0.1) == [2, 3, 4]
    assert off_the_line(sizes, [*line[:3], line[3] * 1.05, *line[4:]], 0.1) == []
    assert off_the_line([1, 2], [1.0, 9.0], 0.1) == []


def test_time_pieces_times_a_size_again_where_a_burst_hit_every_sample():
    """Pieces that sleep 2 ms per size unit; the size-4 one 200 ms more in every call of the first
    pass (a burst longer than the repetitions, which their median keeps). It comes back near 8 ms,
    timed again with its neighbours; a size another rank asks for (``agree``) is timed again too. (The
    burst is long, so that a busy host, which stretches the sleeps, cannot make the 8 ms look like it.)"""
    import time

    bench = BlockBench(model_config(BERT), 1, 8, torch.device("cpu"), "float32")
    calls = {}

    def make(n, burst):
        def fn(x):
            calls[n] = calls.get(n, 0) + 1
            time.sleep(0.002 * n + (0.2 if burst and n == 4 and calls[n] <= 8 else 0.0))
            return x * 2
        return lambda: ([torch.ones(2, requires_grad=True)], fn)

    sizes = [1, 2, 3, 4, 5, 6, 7]
    out = time_pieces(bench, [make(n, True) for n in sizes], sizes, 3, lambda: None)
    # warm-up + 3 rounds, a training and an inference forward each (8), 3 rounds again (6), saved bytes (1)
    assert calls[3] == calls[4] == calls[5] == 15
    assert out[3][0] < 0.1 and out[3][2] < 0.1  # 208 ms with the burst
    calls.clear()
    asked = []
    time_pieces(bench, [make(n, False) for n in sizes], sizes, 3, lambda: None,
                agree=lambda mine: asked.append(mine) or sorted({*mine, 0}))
    assert len(asked) == 1 and calls[1] == 15


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


PLANS = [("bert", (TP, NONE, TP), [3, 1], [40, 24], [8, 8]),
         ("bert", (TP, SP, TP), [1, 3], [24, 40], [11, 5]),
         ("bert", (SP, SP, SP), [2, 2], [32, 32], [6, 10]),
         ("bert", (TP, SP, SP), [3, 1], [32, 32], [9, 7]),
         ("bert", (SP, NONE, TP), [2, 2], [40, 24], [8, 8]),
         ("llama", (SP, SP, TP), [4, 4], [20, 28], [10, 6]),
         ("llama", (TP, NONE, SP), [4, 4], [24, 24], [7, 9])]


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


def count_params(ctx, config):
    from galaxy.core.layers import GradRule, grad_rule
    from galaxy.models import build_model

    cfg = GalaxyConfig.from_dict(config)
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    params = list(model.parameters())
    return (sum(p.numel() for p in params), sum(p.numel() for p in params if grad_rule(p) == GradRule.PARTIAL))


@pytest.mark.parametrize("model_type,methods,heads,ffn,seq", PLANS[:2] + PLANS[3:4] + PLANS[5:])
def test_parameter_counts_match_the_model(dist_pool, model_type, methods, heads, ffn, seq):
    raw = BERT if model_type == "bert" else LLAMA
    names = ("att_parallel_method", "con_parallel_method", "mlp_parallel_method")
    config = {"model": raw, "train": {"seq_length": 16, "global_batch_size": 2},
              "parallel": {**{k: m.value for k, m in zip(names, methods)}, "tp_num_attention_heads_list": heads,
                           "tp_intermediate_size_list": ffn, "seq_scatter_list": seq}}
    real = dist_pool.run(count_params, 2, config)
    m = model_config(raw)
    att, con, mlp = methods
    per_layer = layer_params(m, att, mlp, con, np.array(heads), np.array(ffn))
    edges = sum(edge_params(m))
    for rank, (total, partial) in enumerate(real):
        assert per_layer.total[rank] * m.num_hidden_layers + edges == total
        assert per_layer.partial[rank] * m.num_hidden_layers + (edges if con == SP else 0) == partial


@pytest.mark.parametrize("case", COMM_BYTES_CASES)
def test_step_collectives_match_the_hand_derived_bytes(case):
    """Every collective a training step issues is in the cost model: global rank 0's bytes of a step,
    as the model charges them, equal tests/test_comm_bytes.py's derivation from the serial model's
    shapes (which that test checks against the Communicator's records of real steps): transitions,
    loss, PARTIAL sums per mp_grad_reduce mode, dp buckets, ZeRO-1 broadcasts, gradient norm,
    pipeline sends and the tied-embedding sum."""
    from galaxy.config import PLAN_PRESETS
    from tests.core.test_comm_bytes import BERT as SHAPES, TRAIN, expected_step_bytes

    plan, mp, dp, mode, zero1, pp = case
    raw = dict(SHAPES, model_type="bert")
    cluster = synthetic_cluster(raw, mp * dp * pp, [1.0] * (mp * dp * pp), seq=TRAIN["seq_length"],
                                rows=TRAIN["global_batch_size"])
    work = Workload(cluster.model, "train", TRAIN["global_batch_size"], TRAIN["seq_length"], "float64",
                    mp_grad_reduce=mode, dp_engine="zero1" if zero1 else "ddp")
    methods = PLAN_PRESETS[plan] if plan != "none" else (NONE,) * 3
    pred = predict(cluster, work, methods, Splits.balanced(cluster.model, TRAIN["seq_length"], mp),
                   Layout(dp=dp, pp=pp, microbatches=pp))
    assert pred.detail["comm_bytes"][0] == expected_step_bytes(plan, mp, dp, mode, zero1, pp)


def test_tied_embedding_sum_is_charged_between_pipeline_stages():
    """BERT at pp 2: the word embeddings' gradient (vocab x hidden, float32) crosses the link once per step."""
    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], alpha=0.0, beta=1e-6)
    cluster = dataclasses.replace(cluster, ranks=tuple(dataclasses.replace(r, optimizer=AlphaBeta(0.0, 0.0))
                                                       for r in cluster.ranks))  # parameter counts differ
    work = Workload(cluster.model, "train", 2, 8)
    one = Splits.balanced(cluster.model, 8, 1)
    tied = predict(cluster, work, (NONE,) * 3, one, Layout(pp=2, microbatches=2)).time_s[0]
    untied_model = dataclasses.replace(cluster.model, model_type="llama", tie_word_embeddings=False)
    base = dataclasses.replace(cluster, model=untied_model)
    # the same shapes, only the tie differs: the difference is the all-reduce of the tied gradient
    bert_like = predict(dataclasses.replace(cluster, model=dataclasses.replace(untied_model, tie_word_embeddings=True)),
                        dataclasses.replace(work, model=dataclasses.replace(untied_model, tie_word_embeddings=True)),
                        (NONE,) * 3, one, Layout(pp=2, microbatches=2)).time_s[0]
    untied = predict(base, dataclasses.replace(work, model=untied_model), (NONE,) * 3, one,
                     Layout(pp=2, microbatches=2)).time_s[0]
    v, h = BERT["vocab_size"], BERT["hidden_size"]
    assert bert_like - untied == pytest.approx(1e-6 * v * h * 4, rel=1e-9)
    assert tied > 0


def test_uneven_speeds_move_work_to_the_fast_rank():
    cluster = synthetic_cluster(BERT, 2, [1.0, 3.0], alpha=1e-6, beta=1e-12)
    work = Workload(cluster.model, "train", 2, 8)
    even = predict(cluster, work, (TP, SP, TP), Splits.one([2, 2], [32, 32], [4, 4])).time_s[0]
    skewed = predict(cluster, work, (TP, SP, TP), Splits.one([1, 3], [16, 48], [2, 6])).time_s[0]
    assert skewed < even
    # memory: a rank holding more heads and columns holds more parameters
    mem = predict(cluster, work, (TP, NONE, TP), Splits.one([1, 3], [16, 48], [4, 4])).memory_bytes[0]
    assert mem[1] > mem[0]


def test_pipeline_bubble_and_every_layout_of_four_ranks():
    """Identical stages and free links: the schedule's idle share is (p - 1) / (m + p - 1)."""
    import dataclasses

    from galaxy.planner.search import layouts

    cluster = synthetic_cluster(dict(BERT, num_hidden_layers=4), 4, [1.0] * 4, alpha=0.0, beta=0.0)
    zero = Piece(Curve((1, 2), (0.0, 0.0)), Curve((1, 2), (0.0, 0.0)), Curve((1, 2), (0.0, 0.0)))
    ranks = tuple(dataclasses.replace(r, pieces={n: {**by, "head.tokens": zero} for n, by in r.pieces.items()})
                  for r in cluster.ranks)
    cluster = dataclasses.replace(cluster, ranks=ranks)
    work = Workload(cluster.model, "train", 8, 8)
    one = Splits.balanced(cluster.model, 8, 1)
    for pp, M in ((2, 4), (4, 4), (4, 8)):
        pred = predict(cluster, work, (NONE, NONE, NONE), one, Layout(dp=4 // pp, pp=pp, microbatches=M))
        assert pred.detail["bubble"][0] == pytest.approx((pp - 1) / (M + pp - 1))
    for tier in layouts(cluster, work):  # every dp x pp x mp of four ranks is scored
        for layout in tier:
            mp = 4 // (layout.dp * layout.pp)
            assert np.isfinite(predict(cluster, work, (TP, SP, TP), Splits.balanced(cluster.model, 8, mp),
                                       layout).time_s).all()


# ----------------------------------------------------------------------------- search


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


def test_splits_respect_gqa_groups_and_units():
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 2.2])
    work = Workload(cluster.model, "train", 2, 8)
    for choice in search(cluster, work, ffn_unit=8, top=50):
        assert all(h % 4 == 0 for h in choice.heads) and sum(choice.heads) == 8  # group of 4 query heads
        assert all(f % 8 == 0 and f > 0 for f in choice.ffn) and sum(choice.ffn) == 48
        assert sum(choice.seq) == 8 and min(choice.seq) > 0
    with pytest.raises(ConfigError, match="ffn_unit"):
        search(cluster, work, ffn_unit=5)


# ----------------------------------------------------------------------------- files and CLI


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


def test_cli_bad_cluster_is_one_line(tmp_path, capsys):
    from galaxy.cli.plan import main

    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps({"version": 1, "world": 2}))
    code = main(["--model", "bert-tiny", "--cluster", str(bad), "--out", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "key 'rows' is missing" in err


def test_validate_under_a_launcher_is_one_line(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank would run the search and launch every plan: refused before either."""
    from galaxy.cli.plan import main

    cluster, model = tmp_path / "cluster.json", tmp_path / "model.json"
    synthetic_cluster(BERT, 2, [1.0, 1.0]).save(str(cluster))
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 8, "global_batch_size": 2}}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    code = main(["--model", str(model), "--cluster", str(cluster), "--out", str(tmp_path / "plan.json"),
                 "--validate", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "run plan_galaxy.py with python" in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("objective", ["latency", "train"])
def test_validate_runs_the_top_plans_through_the_clis(tmp_path, capsys, objective):
    """``--validate 2`` runs the two best plans with infer_galaxy.py / pretrain_galaxy.py on local
    processes (latency: twice each), puts each measured time beside its prediction (table and JSON) and
    writes the faster of the two as the plan."""
    from galaxy.cli.plan import main

    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    out = tmp_path / "plan.json"
    runs = "2" if objective == "latency" else "1"  # two launches each, taking turns
    assert main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                 "--objective", objective, "--validate", "2", "--validate_steps", "2", "--validate_runs", runs,
                 "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "measured_ms" in printed and "error" in printed
    rows = json.loads((tmp_path / "plan.plans.json").read_text())["plans"]
    assert all(r["measured_ms"] > 0 for r in rows[:2]) and rows[2]["measured_ms"] is None, rows
    peaks = [r["measured_peak_mb_rank0"] for r in rows]
    assert (all(p > 0 for p in peaks[:2]) if objective == "train" else peaks[:2] == [None, None]) and peaks[2] is None
    # the plan written is the fastest of those measured, whichever the model ranked first
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    fastest = min(range(2), key=lambda i: rows[i]["measured_ms"])
    assert table["picked"] == fastest and json.loads(out.read_text()) == table["configs"][fastest]
    assert f"the fastest validated plan (rank {rows[fastest]['rank']}" in printed


def test_validate_writes_the_fastest_measured_plan_not_the_first_predicted(tmp_path, capsys, monkeypatch):
    """The model ranks the plans; among those ``--validate`` ran, the measured fastest is the plan written (here
    the second: the launches are replaced by fixed times, the first plan measured slowest)."""
    from galaxy.cli import plan as plan_cli

    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    launched = []

    def measure(config, world, args):
        launched.append(config)
        return plan_cli.Measured([0.3, 0.1, 0.2][len(launched) - 1], 1.0)
    monkeypatch.setattr(plan_cli, "validate", measure)
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                          "--validate", "3", "--top", "3"]) == 0
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    assert [r["measured_ms"] for r in table["plans"]] == [300.0, 100.0, 200.0] and table["picked"] == 1
    assert json.loads(out.read_text()) == table["configs"][1] == launched[1] != table["configs"][0]


def test_validate_on_an_emulated_cluster_refuses_another_world(tmp_path, capsys):
    from galaxy.cli.plan import main

    synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16).save(str(tmp_path / "cluster.json"))
    emulated = tmp_path / "emulated.json"
    emulated.write_text(json.dumps({"ranks": [{"compute_share": 0.5}] * 3}))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    code = main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"),
                 "--out", str(tmp_path / "plan.json"), "--validate", "1", "--emulate", str(emulated)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "has 3 ranks but the cluster file" in err, err


def train_two_steps(ctx, config):
    from galaxy.models import build_model
    from galaxy.train.loop import train
    from galaxy.data.pretraining import mlm_data

    cfg = GalaxyConfig.from_dict(config, {"max_steps": 2})
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    result = train(model, mlm_data(cfg)[0], cfg, ctx)
    return result.losses


def test_written_plan_loads_and_trains(tmp_path, dist_pool, capsys):
    from galaxy.cli.plan import main

    cluster = synthetic_cluster(BERT, 2, [1.0, 2.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 4}}))
    out = tmp_path / "plan.json"
    assert main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                 "--ffn_unit", "8"]) == 0
    assert "predicted_ms" in capsys.readouterr().out
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    assert table["configs"][0] == json.loads(out.read_text())
    times = [p["predicted_ms"] for p in table["plans"]]
    assert times == sorted(times)
    # the best plan, and the best one that splits the model over both ranks, train as written
    GalaxyConfig.from_file(str(out))
    split = next(c for c in table["configs"] if c["parallel"]["dp_size"] * c["parallel"]["pp_size"] == 1)
    for config in (table["configs"][0], split):
        par = config["parallel"]
        world = len(config.get("distributed", {}).get("devices") or [0, 1])
        losses = dist_pool.run(train_two_steps, world, config, dp=par["dp_size"], pp=par["pp_size"])[0]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def profile_case(ctx, raw):
    from galaxy.planner.profile import profile_rank

    cluster = profile_rank(ctx, model_config(raw), rows=[1, 2], seq=8, dtype="float32", reps=1, most_bytes=2**14)
    return None if cluster is None else cluster.to_dict()


def test_profiler_writes_a_valid_file(dist_pool):
    """The profiler on two real ranks: every piece, the optimizer and the group's fits, readable back."""
    raw = dist_pool.run(profile_case, 2, LLAMA)[0]
    cluster = cluster_from_dict(raw, "profiled")
    assert cluster.world == 2 and set(cluster.groups) == {(0, 1)}
    assert cluster.rows == (1, 2)
    heads = cluster.ranks[1].pieces[2]["att_proj.heads"].fwd.sizes
    assert heads == (4, 8)  # whole GQA groups only
    assert all(p.infer is not None and p.infer.sizes == p.fwd.sizes for p in cluster.ranks[0].pieces[1].values())
    assert raw == cluster.to_dict()
    for op in OPS:  # both roles: the last member to arrive, and the one that waited
        for ab in (cluster.collective([0, 1], op), cluster.waiting_leave([0, 1], op)):
            assert ab.alpha_s >= 0 and ab.beta_s_per_byte >= 0 and len(ab.samples) >= 2
    assert set(cluster.early_leave) == {(0, 1)}
    assert all(r.memory_bytes > 0 and r.step_overhead_s >= 0 and r.forward_overhead_s >= 0 for r in cluster.ranks)
    assert all(0.5 <= r.step_compute_scale <= 1 and 0.5 <= r.forward_compute_scale <= 1 for r in cluster.ranks)
    # the serial runs, timed before and after the pieces, are kept and reproduce the calibration
    from galaxy.planner.profile import calibrated

    for r in cluster.ranks:
        assert len(r.serial_steps_s) == len(r.serial_forwards_s) == 2 and min(r.serial_steps_s) > 0
        again = calibrated(r, cluster.model, 2, 8, "float32", r.serial_steps_s, r.serial_forwards_s)
        assert again == r


def test_all_reduce_is_timed_up_to_a_gradient_bucket():
    """Activation collectives up to world x K and V of the largest batch; all-reduce also up to the
    25 MiB bucket the gradient sync sends (or the whole gradient, when smaller)."""
    from galaxy.planner.simulate import GRAD_BUCKET_BYTES
    from galaxy.planner.profile import collective_sizes, model_params

    large = model_config({**BERT, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                          "vocab_size": 8192})
    sizes = collective_sizes(large, 2, 128, 2)
    assert max(sizes["all_gather"]) == max(sizes["reduce_scatter"]) == 2 * 2 * 2 * 128 * 1024 * 4
    assert max(sizes["all_reduce"]) == GRAD_BUCKET_BYTES < model_params(large) * 4
    assert sizes["all_reduce"][:len(sizes["all_gather"]) - 1] == sizes["all_gather"][:-1]
    small = collective_sizes(model_config(BERT), 2, 8, 2)
    assert small["all_reduce"] == small["all_gather"] and max(small["all_gather"]) == 2**20
    assert all(max(v) == 2**14 for v in collective_sizes(large, 2, 128, 2, most_bytes=2**14).values())


def test_profiler_on_three_ranks(tmp_path):
    """Three local ranks (the CLI's own launch): every subgroup a plan can use is created and timed.
    It hung once: members that had created different numbers of groups named the next one apart."""
    import os
    import subprocess
    import sys

    root = REPO
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 8, "global_batch_size": 2}}))
    out = tmp_path / "cluster.json"
    run = subprocess.run([sys.executable, os.path.join(root, "plan_galaxy.py"), "profile", "--model", str(model),
                          "--world", "3", "--rows", "2", "--reps", "1", "--window_ms", "0", "--out", str(out)],
                         env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    cluster = load_cluster(str(out))
    assert cluster.world == 3 and set(cluster.groups) == set(candidate_groups(3)) == {(0, 1, 2), (0, 1), (1, 2), (0, 2)}
    for group in cluster.groups:
        assert all(cluster.collective(group, op).beta_s_per_byte >= 0 for op in OPS)
