"""The profiler on Galaxy's own models and plans: per-rank FLOPs that add up to the serial count
plus the reported replicated compute, parameters local and global, bytes per layer against the
volume computed here from the shapes, repeatability, overhead, the training-loop hook and the
FlopCounterMode reference on our BERT and LLaMA."""

import json
import statistics
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from galaxy.config import GalaxyConfig, Method, Plan
from galaxy.core.comm import Communicator
from galaxy.core.context import ParallelContext
from galaxy.models import model_class
from galaxy.models.bert import BertForMaskedLM
from galaxy.profiler.flops_profiler import FlopsProfiler
from galaxy.profiler.formulas import extra_flop_formulas
from galaxy.profiler.parallel import ParallelProfiler, partial_grad_bytes, replicated_module_map, transition_label
from galaxy.profiler.step import StepProfiler
from tests import REPO  # noqa: E402
from tests.in_process import run_script

ROOT = REPO

B, S, H, V, FFN = 4, 24, 32, 300, 64
FP32 = 4
SMALL = {"model": {"preset": "bert-tiny", "vocab_size": V, "hidden_size": H, "num_attention_heads": 4,
                   "intermediate_size": FFN, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
         "train": {"global_batch_size": B, "seq_length": S}}
UNEVEN3 = {"seq_scatter_list": [10, 8, 6], "tp_num_attention_heads_list": [2, 1, 1],
           "tp_intermediate_size_list": [32, 20, 12]}


def _mlm_batch(vocab=V, batch=B, seq=S):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.where(torch.rand(batch, seq, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]
    return {"input_ids": ids, "labels": labels}


def _bert(ctx, plan, extra=None, layers=2):
    cfg = GalaxyConfig.from_dict(SMALL, dict({"plan": plan, "num_hidden_layers": layers}, **(extra or {})))
    return BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx)


def _numbers(data):
    """The counts of a profile, without its timings."""
    return {
        "sum": {k: data["sum"][k] for k in ("flops", "macs", "replicated", "redundant", "serial_equivalent",
                                            "params_local", "comm_bytes")},
        "ranks": [{k: r[k] for k in ("rank", "params", "flops", "macs", "replicated", "comm_bytes", "comm_calls")}
                  for r in data["ranks"]],
        "by_module": data["comm"]["by_module"],
        "rows": [{k: v for k, v in r.items() if k not in ("seconds", "GBps")} for r in data["comm"]["rows"]],
        "modules": [(m["name"], m["fwd_flops"], m["bwd_flops"]) for m in data["local"]["modules"]],
    }


def profile_bert_twice(ctx, plan, extra):
    model = _bert(ctx, plan, extra)
    batch = _mlm_batch()

    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    prof = ParallelProfiler(model, batch=B, seq_len=S)
    first = prof.profile(step)
    second = prof.profile(step)
    assert prof._observer not in ctx.mp.observers  # detached when the window closes
    return first, _numbers(first) == _numbers(second)


@pytest.fixture(scope="module")
def profiles(dist_pool):
    """``profiles(plan, world, extra)``: every rank's (profile, same-twice) of the small BERT, run once
    per module and shared by the tests below."""
    cache = {}

    def get(plan, world, extra):
        key = (plan, world, tuple(sorted((k, tuple(v)) for k, v in extra.items())))
        if key not in cache:
            cache[key] = dist_pool.run(profile_bert_twice, world, plan, extra)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def serial_bert(profiles):
    return profiles("none", 1, {})[0][0]


CASES = [("tp", 2, {}), ("galaxy", 2, {}), ("sp", 2, {}), ("galaxy2", 2, {}), ("galaxy", 3, UNEVEN3),
         ("tp", 3, UNEVEN3)]


@pytest.mark.parametrize("plan,world,extra", CASES, ids=[f"{p}-{w}{'-uneven' if e else ''}" for p, w, e in CASES])
def test_rank_flops_sum_to_serial_plus_replicated(profiles, serial_bert, plan, world, extra):
    out = profiles(plan, world, extra)
    assert all(same for _, same in out), "profiling twice gives the same numbers"
    data = out[0][0]
    serial = serial_bert["sum"]["flops"]
    assert [r["rank"] for r in data["ranks"]] == list(range(world))
    summed = data["sum"]["flops"]
    for ph in ("fwd", "bwd", "total"):
        assert summed[ph] == sum(r["flops"][ph] for r in data["ranks"])
        assert summed[ph] == serial[ph] + data["sum"]["redundant"][ph], ph
        assert data["sum"]["serial_equivalent"][ph] == serial[ph]
    # Every rank holds the same gathered table.
    assert all(_numbers(d)["sum"] == _numbers(data)["sum"] for d, _ in out)
    per_rank = data["replicated"]["per_rank"]
    if plan == "tp":
        # CON=None: the MLM head (transform dense and the tied decoder) runs whole on every rank.
        head_fwd = 2 * B * S * H * (H + V)
        assert per_rank == {"fwd": head_fwd, "bwd": 2 * head_fwd, "total": 3 * head_fwd}
        assert data["sum"]["redundant"]["total"] == (world - 1) * 3 * head_fwd
        assert {m["name"] for m in data["replicated"]["modules"]} == {"cls.predictions",
                                                                       "cls.predictions.transform.dense"}
        assert data["replicated"]["zero_flop_modules"]["LayerNorm"] == 2 * 2 + 2  # layers, embeddings, head
    else:
        assert per_rank["total"] == 0 and data["sum"]["redundant"]["total"] == 0
    # Parameters: global = the serial model's; the local counts add up to global + the whole copies.
    params = data["params"]
    assert params["global"] == serial_bert["params"]["local"] == params["global_trainable"]
    assert params["sum_over_ranks"] == sum(r["params"]["local"] for r in data["ranks"])
    assert params["sum_over_ranks"] == params["global"] + (world - 1) * params["whole_local"]


# Collectives of one layer: (calls, bytes per call), from the shapes (Communicator convention: an
# all-gather counts the gathered tensor, a reduce-scatter and an all-reduce their input).
BSH = B * S * H * FP32
PER_LAYER = {
    "galaxy": {"reduce_scatter/fwd": (2, BSH), "all_gather/fwd": (2, BSH),
               "all_gather/bwd": (2, BSH), "reduce_scatter/bwd": (2, BSH)},
    "tp": {"all_reduce/fwd": (2, BSH), "all_reduce/bwd": (2, BSH)},
    "sp": {"all_gather/fwd": (1, 2 * BSH), "reduce_scatter/bwd": (1, 2 * BSH)},  # K and V in one gather
    "galaxy2": {"reduce_scatter/fwd": (1, BSH), "all_gather/fwd": (1, BSH),
                "all_gather/bwd": (1, BSH), "reduce_scatter/bwd": (1, BSH)},
}
LABELS = {
    "galaxy": {("all_gather", "fwd"): "S->T (into ATT.tp, into MLP.tp)",
               ("reduce_scatter", "fwd"): "P->S (out of ATT.tp, out of MLP.tp)",
               ("all_reduce", "fwd"): "P->R (loss / [CLS] reduce)"},
    "tp": {("all_reduce", "fwd"): "P->R (out of ATT.tp, out of MLP.tp)",
           ("all_reduce", "bwd"): "R->T (into ATT.tp, into MLP.tp)"},
    "sp": {("all_gather", "fwd"): "S->T (ATT.sp K/V gather)", ("reduce_scatter", "bwd"): "S->T (ATT.sp K/V gather)"},
}


@pytest.mark.parametrize("plan,world,extra", [("galaxy", 2, {}), ("tp", 2, {}), ("sp", 2, {}), ("galaxy2", 2, {}),
                                              ("galaxy", 3, UNEVEN3)])
def test_bytes_per_layer_equal_the_analytic_volume(profiles, plan, world, extra):
    out = profiles(plan, world, extra)
    for data, _ in out:  # every rank moves the same volume, uneven splits included
        comm = data["comm"]
        assert comm["layers"] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
        for layer in comm["layers"]:
            got = {k: (v["calls_per_step"], v["bytes_per_step"]) for k, v in comm["by_module"][layer].items()}
            assert got == {k: (calls, calls * size) for k, (calls, size) in PER_LAYER[plan].items()}, layer
        # Outside the layers, only the loss of a sequence-sharded stream is reduced (one fp32 scalar).
        layer_bytes = sum(v["bytes_per_step"] for layer in comm["layers"] for v in comm["by_module"][layer].values())
        model_bytes = sum(v["bytes_per_step"] for v in comm["by_module"][""].values())
        assert model_bytes - layer_bytes == (FP32 if plan != "tp" else 0)
        assert data["sum"]["comm_bytes"]["total"] == world * model_bytes
        labels = {(r["op"], r["phase"]): r["transition"] for r in comm["rows"]}
        for key, label in LABELS.get(plan, {}).items():
            assert labels[key] == label


def test_transition_labels_and_replication_rule():
    def plan(att, con, mlp):
        return Plan(att, con, mlp, (2, 2), (32, 32), (12, 12))

    tp, sp = Method.TP, Method.SP
    none = Method.NONE
    assert transition_label("all_reduce", "bwd", plan(tp, none, tp)) == "R->T (into ATT.tp, into MLP.tp)"
    assert transition_label("all_gather", "bwd", plan(tp, sp, sp)) == "P->S (out of ATT.tp)"
    assert transition_label("reduce_scatter", "bwd", plan(tp, sp, sp)) == "S->T (into ATT.tp)"
    assert transition_label("all_gather", "fwd", plan(sp, sp, tp)) == "S->T (into MLP.tp, ATT.sp K/V gather)"
    assert (transition_label("all_gather", "fwd", plan(sp, none, sp))
            == "S->R (out of ATT.sp, out of MLP.sp) | S->T (ATT.sp K/V gather)")
    assert transition_label("all_reduce", "other", plan(tp, sp, tp)).startswith("outside forward/backward")
    assert transition_label("all_reduce", "fwd", plan(tp, sp, tp), group="dp") == "dp group"
    assert transition_label("broadcast", "fwd", plan(tp, sp, tp)) == "not a transition of this plan"

    cfg = GalaxyConfig.from_dict(SMALL)
    ctx = ParallelContext(rank=0, world_size=2, device=torch.device("cpu"), seed=0, mp=Communicator("mp", 0, 2))
    model = BertForMaskedLM(cfg.model, plan(tp, none, tp), ctx)  # built only: no collective runs
    rep = replicated_module_map(model, model.plan)
    assert rep["cls.predictions"] and rep["cls.predictions.transform.dense"]
    assert rep["bert.encoder.layer.0.output.LayerNorm"] and rep["bert.embeddings"]
    assert not rep["bert.encoder.layer.0"]  # the attention core is split by heads
    assert not rep["bert.encoder.layer.0.attention.self.query"]


# ----------------------------------------------------------------------------- overhead


def overhead_ratio(ctx, model_type, runs=5):
    """Median over paired runs of (profiled step) / (plain step), each timed by this thread's CPU time,
    where the profiler's work runs (not by the wall clock, which counts the time a busy host keeps the
    rank waiting); a sanity bound, not a benchmark."""
    if model_type == "bert":  # the pretraining CLIs' embedded default: bert-tiny, 512 tokens, 16 x 64
        cfg = GalaxyConfig.from_dict({"model": {"preset": "bert-tiny", "vocab_size": 512, "hidden_dropout_prob": 0.0,
                                                "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 128},
                                      "train": {"global_batch_size": 16, "seq_length": 64}}, {"plan": "galaxy"})
    else:  # the llama-tiny preset at the default batch (8 x 128)
        cfg = GalaxyConfig.from_dict({"model": {"preset": "llama-tiny"}}, {"plan": "galaxy"})
    model = model_class(model_type)(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx)
    batch = _mlm_batch(cfg.model.vocab_size, cfg.train.global_batch_size, cfg.train.seq_length)

    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    prof = ParallelProfiler(model)
    for _ in range(2):
        step()
        prof.profile(step)
    ratios = []
    for _ in range(runs):
        start = time.thread_time()
        step()
        plain = time.thread_time() - start
        start = time.thread_time()
        prof.profile(step)
        ratios.append((time.thread_time() - start) / plain)
    return statistics.median(ratios)


@pytest.mark.parametrize("model_type,world", [("bert", 2), ("llama", 1)])
def test_profiled_step_costs_at_most_3x_a_plain_step(dist_pool, model_type, world):
    ratio = dist_pool.run(overhead_ratio, world, model_type)[0]
    assert ratio <= 3.0, f"a profiled step cost {ratio:.2f}x a plain step"


# ----------------------------------------------------------------------------- training-loop hook


def train_with_step_profiler(ctx, json_path):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": "galaxy"})
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx)
    from galaxy.core.grad_sync import GradientSync

    sync = GradientSync([p for p in model.parameters()], ctx.mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _mlm_batch()
    prof = StepProfiler(model, ctx, step=2, json_file=json_path, batch=B, seq_len=S)
    reports = []
    for step in range(1, 4):
        prof.before_step(step)
        model(**batch).loss.backward()
        sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reports.append(prof.after_step(step))
    assert prof.profiler._observer not in ctx.mp.observers
    return reports, prof.result, partial_grad_bytes(model)


def test_step_profiler_reports_step_k_only(dist_pool, tmp_path, serial_bert):
    path = str(tmp_path / "step2.json")
    out = dist_pool.run(train_with_step_profiler, 2, path)
    for reports, result, grad_bytes in out:
        assert reports[0] is None and reports[2] is None
        assert "Profile Summary at step 2" in reports[1] and "Parallel Profile" in reports[1]
        # The optimizer adds no FLOPs (elementwise): forward + backward of the serial model.
        assert result["sum"]["serial_equivalent"] == serial_bert["sum"]["flops"]
        assert result["comm"]["grad_sync"]["bytes_per_step"] == grad_bytes > 0
    written = json.loads(open(path).read())
    assert written["sum"]["flops"] == out[0][1]["sum"]["flops"]


def test_a_failing_step_closes_the_window():
    cfg = GalaxyConfig.from_dict(SMALL)
    model = BertForMaskedLM(cfg.model)
    prof = ParallelProfiler(model)

    def bad_step():
        model(**_mlm_batch())
        raise KeyError("boom")

    with pytest.raises(KeyError):
        prof.profile(bad_step)
    assert not prof.flops.started and prof._observer not in model.ctx.mp.observers
    data = prof.profile(lambda: model(**_mlm_batch()).loss.backward())
    assert data["ranks"][0]["flops"]["bwd"] > 0 and data["replicated"]["per_rank"]["total"] == 0


# ----------------------------------------------------------------------------- FlopCounterMode on our models


def _galaxy_model(model_type):
    preset = {"bert": {"preset": "bert-tiny", "vocab_size": 256}, "llama": {"preset": "llama-tiny"}}[model_type]
    cfg = GalaxyConfig.from_dict({"model": preset, "train": {"seq_length": 32}})
    return model_class(model_type)(cfg.model, None, ParallelContext.serial(), seed=1), cfg


@pytest.mark.parametrize("model_type", ["bert", "llama"])
@pytest.mark.parametrize("backward", [False, True])
def test_galaxy_models_equal_flop_counter_mode(model_type, backward):
    model, cfg = _galaxy_model(model_type)
    batch = _mlm_batch(cfg.model.vocab_size, 2, cfg.train.seq_length)
    model.train(backward)  # train: BERT's dropout takes the math attention path; eval: SDPA
    prof = FlopsProfiler(model)
    prof.start_profile()
    # The CPU fused attention kernel has no formula in torch's registry: give FlopCounterMode ours.
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as fc:
        with torch.set_grad_enabled(backward):
            out = model(**batch)
            if backward:
                out.loss.backward()
    prof.stop_profile()
    assert prof.get_total_flops() == fc.get_total_flops() > 0
    assert (prof.get_total_flops(phase="bwd") > 0) == backward
    assert prof.get_uncounted_ops() == {}
    excl = prof.get_flops_by_module(exclusive=True)
    assert sum(excl.values()) == prof.get_flops_by_module()[""] == prof.get_total_flops()


# ----------------------------------------------------------------------------- the CLI


def _llama_forward_flops(h, inter, layers, vocab, seq, batch=1):
    t = batch * seq
    return layers * (2 * t * h * 4 * h + 3 * 2 * t * h * inter + 4 * batch * seq * seq * h) + 2 * t * h * vocab


def test_meta_llama_7b_forward_via_cli(tmp_path, capsys):
    from galaxy.cli.profile import main

    path = tmp_path / "llama7b.json"
    rc = main(["--model", "llama", "--override", "preset=llama-7b", "--meta", "--batch", "1", "--seq_len", "128",
               "--json", str(path), "--no_detailed", "--forward_only"])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(path.read_text())
    fwd = data["local"]["flops"]["fwd"]
    assert fwd == pytest.approx(1700e9, rel=0.005)
    assert fwd == pytest.approx(_llama_forward_flops(4096, 11008, 32, 32000, 128), rel=1e-9)
    assert data["params"]["global"] == 6_738_415_616
    assert data["step"]["meta"] and data["run"]["timed"] is False
    assert "not measured (shapes-only run" in capsys.readouterr().out


def test_cli_refuses_meta_on_several_ranks(capsys):
    from galaxy.cli.profile import main

    assert main(["--meta", "--world", "2"]) == 2
    assert "--meta runs on one rank" in capsys.readouterr().err


def test_cli_world_2_writes_per_rank_json(tmp_path):
    path = tmp_path / "out.json"
    cmd = ["profile_flops.py", "--model", "bert", "--world", "2", "--backward", "--json", str(path),
           "--batch", "2", "--seq_len", "32", "--warm_up", "0", "--check_serial", "--no_detailed"]
    out = run_script(cmd, cwd=ROOT, timeout=120)  # in this process (tests.in_process); the ranks are processes
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Parallel Profile (model-parallel group of 2)" in out.stdout
    data = json.loads(path.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert all(r["flops"]["fwd"] > 0 and r["flops"]["bwd"] > 0 for r in data["ranks"])
    assert data["run"]["plan"] == "galaxy" and data["run"]["world_size"] == 2
    assert data["serial_check"]["match"] is True
    assert data["comm"]["grad_sync"]["bytes_per_step"] > 0
