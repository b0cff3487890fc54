"""galaxy.planner.profile: the calibration of a rank's pieces by its real serial runs (times, a layer's time
and peak growth from two depths, the fastest run's overhead, the workload's dtype), sustained steps, the
collective sizes timed, and the profiler on two real ranks (Gloo) writing a file that reads back."""

import dataclasses
import statistics

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.planner.cluster import OPS, cluster_from_dict
from galaxy.planner.profile import model_params
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Splits, Workload
from tests.planner.helpers import BERT, LLAMA, NONE, SP, TP, model_config, synthetic_cluster


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
