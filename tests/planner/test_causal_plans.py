"""The planner on causal LMs: the memory the sharding options save, the layouts the search covers,
and profile + search + --validate of llama-tiny through the CLIs end to end."""

import dataclasses
import json
import os

import numpy as np
import pytest

from galaxy.config import Method
from galaxy.planner import group
from galaxy.planner.memory import bytes_per_parameter
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Layout, Splits, Workload
from galaxy.planner.search import layouts, search
from galaxy.planner.workload import edge_params, layer_params
from tests import REPO
from tests.in_process import run_script
from tests.planner.helpers import LLAMA, synthetic_cluster

TP, SP, NONE = Method.TP, Method.SP, Method.NONE
GALAXY = (TP, SP, TP)


def rank_params(cluster, methods, mp):
    """(parameters, PARTIAL parameters) of rank 0 of a whole model (pp 1) on an even split."""
    m = cluster.model
    s = Splits.balanced(m, cluster.seq_length, mp)
    layer = layer_params(m, methods[0], methods[2], methods[1], s.heads[0, 0], s.ffn[0, 0])
    emb, head = edge_params(m)
    edge_partial = emb + head if methods[1] == SP else 0
    L = m.num_hidden_layers
    return int(layer.total * L + emb + head), int(layer.partial * L + edge_partial)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_partial_gradients_save_what_they_shard(dtype):
    """mp_grad_reduce sharded: a PARTIAL weight is held once (compute dtype under autocast) and its master,
    gradient and optimizer state as a 1/mp piece; nothing else changes. At one micro-batch the peak (its
    forward's end, where the activations outweigh the gradients here) holds no gradient of either."""
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 1.0], seq=64, rows=8, memory=2**40)
    n, partial = rank_params(cluster, GALAXY, 2)
    assert 0 < partial < n
    base = Workload(cluster.model, "train", 8, 64, dtype)
    split = Splits.balanced(cluster.model, 64, 2)
    mem = {(mode, micro): predict(cluster, Workload(cluster.model, "train", 8 * micro, 64, dtype, mp_grad_reduce=mode),
                                  GALAXY, split, Layout(microbatches=micro)).memory_bytes[0, 0]
           for mode in ("after_backward", "overlap", "sharded") for micro in (1, 2)}
    assert mem["after_backward", 1] == mem["overlap", 1]
    low = dtype == "bfloat16"
    whole = 4 + 4 + 8 + (2 if low else 0)  # fp32 weight, gradient, AdamW's two moments, autocast's copy
    piece = (2 if low else 4) + (4 + 4 + 8) / 2
    sharded = Workload(cluster.model, "train", 8, 64, dtype, mp_grad_reduce="sharded")
    assert bytes_per_parameter(base, 1, 2, 1) == (whole, whole)
    assert bytes_per_parameter(sharded, 1, 2, 1) == (whole, piece)
    assert bytes_per_parameter(sharded, 1, 2, 1, gradients=False) == (whole - 4, piece - 4 / 2)
    assert mem["after_backward", 1] - mem["sharded", 1] == pytest.approx(partial * (whole - 4 - (piece - 4 / 2)))
    # with micro-batches the PARTIAL gradients accumulate on the weights before the last backward buckets them
    weight = 2 if low else 4
    assert mem["after_backward", 2] - mem["sharded", 2] == pytest.approx(partial * (whole - piece - weight))


def test_dp_engines_shard_optimizer_state_and_gradients():
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 1.0], seq=8, memory=2**40)
    n, _ = rank_params(cluster, (NONE,) * 3, 1)
    one = Splits.balanced(cluster.model, 8, 1)

    def memory(engine, stage=1):  # (two micro-batches: the peak holds the gradients, DeepSpeed's or not)
        work = Workload(cluster.model, "train", 4, 8, dp_engine=engine, zero_stage=stage)
        return predict(cluster, work, (NONE,) * 3, one, Layout(dp=2, microbatches=2)).memory_bytes[0, 0]

    assert memory("ddp") - memory("zero1") == pytest.approx(n * 8 / 2)  # half of AdamW's state
    assert memory("deepspeed", 1) == memory("zero1")
    assert memory("zero1") - memory("deepspeed", 2) == pytest.approx(n * 4 / 2)  # and half of the gradients
    # float64 runs keep float64 masters, gradients and moments; no autocast copy in float32 or float64
    assert bytes_per_parameter(Workload(cluster.model, "train", 2, 8, "float64"), 2, 1, 1) == (32, 32)
    assert bytes_per_parameter(Workload(cluster.model, "train", 2, 8, "float32", dp_engine="zero1"), 2, 1, 1) == \
        (4 + 4 + 4, 4 + 4 + 4)


def test_layouts_reach_one_row_micro_batches_and_selective_recompute():
    cluster = synthetic_cluster(LLAMA, 2, [1.0, 1.0], seq=8)
    work = Workload(cluster.model, "train", 12, 8)
    every = [layout for tier in layouts(cluster, work) for layout in tier]
    assert {(l.microbatches, l.recompute) for l in every if l.dp == 1 and l.pp == 1} == \
        {(m, r) for m in (1, 2, 3, 4, 6, 12) for r in ("none", "selective", "mlp", "full")}
    assert {l.microbatches for l in every if l.pp == 2} == {2, 3, 4, 6, 12}
    ds = [l for tier in layouts(cluster, Workload(cluster.model, "train", 12, 8, dp_engine="deepspeed")) for l in tier]
    assert ds and {(l.dp, l.pp) for l in ds} == {(2, 1)}
    # selective recompute keeps all but the attention cores' activations, mlp all but the MLPs' and their
    # inputs: between none and full; each costs its pieces' forward once more
    split = Splits.balanced(cluster.model, 8, 2)
    pred = {r: predict(cluster, work, GALAXY, split, Layout(recompute=r)) for r in ("none", "selective", "mlp", "full")}
    mem = {r: p.memory_bytes[0, 0] for r, p in pred.items()}
    assert mem["full"] < mem["selective"] < mem["none"]
    assert mem["full"] < mem["mlp"] < mem["none"]
    g = group.GroupModel(cluster, work, GALAXY, split, [0, 1], 12)
    mlp_fwd = sum(e.fwd for e in g.layer() if isinstance(e, group.Compute) and e.name.startswith("mlp"))[0].max()
    assert pred["mlp"].time_s[0] > pred["none"].time_s[0] + cluster.model.num_hidden_layers * mlp_fwd * 0.99


def test_search_finds_the_layout_only_the_new_candidates_fit():
    """A budget that no layout of the old candidate set fits (micro-batches 1/2/4/8, no or full recompute)
    but a one-row micro-batch or selective recompute does: the search returns a fitting plan of those."""
    cluster = synthetic_cluster(LLAMA, 1, [1.0], seq=8, rows=1)
    work = Workload(cluster.model, "train", 16, 8)
    one = Splits.balanced(cluster.model, 8, 1)

    def mem(layout):
        return predict(cluster, work, (NONE,) * 3, one, layout).memory_bytes[0, 0]

    old = min(mem(Layout(microbatches=m, recompute=r)) for m in (1, 2, 4, 8) for r in ("none", "full"))
    new = {(m, r): mem(Layout(microbatches=m, recompute=r)) for m in (1, 2, 4, 8, 16) for r in ("selective", "full",
                                                                                                 "none")}
    best_new = min(new.values())
    assert best_new < old
    budget = (best_new + old) / 2
    tight = dataclasses.replace(cluster, ranks=tuple(dataclasses.replace(r, memory_bytes=int(budget))
                                                     for r in cluster.ranks))
    choice = search(tight, work, top=1)[0]
    assert choice.fits and max(choice.memory_bytes) <= budget
    assert (choice.layout.microbatches, choice.layout.recompute) not in \
        {(m, r) for m in (1, 2, 4, 8) for r in ("none", "full")}


def run(argv, timeout=300):
    """``python argv`` in this process (tests.in_process: a new interpreter would only import torch and Galaxy
    again); the processes it starts are its own."""
    return run_script(argv, timeout=timeout)


def test_profile_search_and_validate_llama_tiny_end_to_end(tmp_path):
    """plan_galaxy.py profile on two CPU ranks, the search, and --validate 1 through pretrain_galaxy.py:
    the table prints the measured time next to the predicted one."""
    shape = ["--model", "llama-tiny", "--seq_length", "32", "--global_batch_size", "4"]
    cluster = tmp_path / "cluster.json"
    out = run([os.path.join(REPO, "plan_galaxy.py"), "profile", *shape, "--world", "2", "--rows", "1", "2",
               "--reps", "1", "--window_ms", "0", "--out", str(cluster)])
    assert out.returncode == 0 and cluster.is_file(), out.stderr[-3000:]
    plan = tmp_path / "plan.json"
    out = run([os.path.join(REPO, "plan_galaxy.py"), *shape, "--cluster", str(cluster), "--out", str(plan),
               "--validate", "1", "--validate_steps", "3", "--top", "3"])
    assert out.returncode == 0, out.stderr[-3000:]
    header = next(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert header.index("predicted_ms") < header.index("measured_ms")
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    assert table["configs"][0]["model"]["model_type"] == "llama"
    rows = table["plans"]
    assert rows[0]["measured_ms"] > 0 and rows[0]["predicted_ms"] > 0 and rows[1].get("measured_ms") is None
    assert np.isfinite(rows[0]["measured_ms"])


def test_calibration_runs_a_model_of_fewer_layers_and_the_profile_keeps_the_whole(monkeypatch):
    """``--calibration_layers``: the serial steps (a 7B step does not fit one device) run a shorter model;
    the profile describes the whole model and predicts its steps from the per-layer pieces."""
    from galaxy.core.context import ParallelContext
    from galaxy.planner import profile
    from tests.planner.helpers import model_config

    m = model_config(LLAMA)
    seen, real = [], profile.measure_serial

    def spy(model, *args, **kwargs):
        seen.append(model.num_hidden_layers)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(profile, "measure_serial", spy)
    # the pieces as a synthetic profile gives them (timing every block is profile_rank's slow part, tested elsewhere)
    pieces = synthetic_cluster(LLAMA, 1, [1.0], seq=8, rows=1).ranks[0].pieces[1]
    monkeypatch.setattr(profile, "measure_blocks", lambda *args, **kwargs: pieces)
    cluster = profile.profile_rank(ParallelContext.serial(), m, rows=[1], seq=8, dtype="float32", reps=1,
                                   calibration_layers=1)
    assert seen == [1, 1] and cluster.model.num_hidden_layers == m.num_hidden_layers == 2
    assert len(cluster.ranks[0].serial_steps_s) == 2
    one = Splits.balanced(m, 8, 1)
    assert predict(cluster, Workload(m, "train", 1, 8), (NONE,) * 3, one).time_s[0] > 0
