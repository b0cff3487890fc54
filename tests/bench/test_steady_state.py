"""One definition of a run's speed for the training CLI and bench/bench_train.py: the steady state, the steps after
``WARMUP_STEPS`` (and no profiled step), their median step time, tokens/s and MFU of the mean step at it, MFU both
with the full attention matrix (12 L H S) and with causal attention's half (6 L H S). On 4 x H200 the CLI's
validation took the median of 2 host-timed steps after only the first (1,391.8 ms) where bench_train took the median
of 3 after 2 warm-up steps (1,322.7) for the same configuration; the summary now times the steps bench_train
times."""

import json
import statistics

import pytest
import torch

from bench.bench_train import timed_steps
from galaxy.cli.pretrain import DEFAULT_BERT
from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.data.pretraining import mlm_data
from galaxy.peft import build_base
from galaxy.profiler.model_flops import training_flops_per_token
from galaxy.train.loop import train
from galaxy.train.options import Reporting
from galaxy.train.metrics import (WARMUP_STEPS, PeakFlops, SteadyState, causal_flops_per_token, model_flops_per_token,
                                  model_matmul_weights)

LLAMA_7B = {"model": {"preset": "llama-7b"}, "train": {"seq_length": 4096}}


def bench_timed_indices(warmup: int, iters: int) -> list[int]:
    """The 1-based steps bench_train's ``timed_steps`` times: it runs them all and returns every step's loss and
    the times of the last ``iters``, so the timed ones are read off the losses (each step's loss is its index)."""
    calls = []

    def step():
        calls.append(len(calls) + 1)
        return torch.tensor(float(calls[-1]))

    times, losses = timed_steps(step, torch.device("cpu"), warmup, iters)
    assert losses == calls and len(times) == iters
    return [int(x) for x in losses[len(losses) - len(times):]]


def test_the_run_summary_times_the_steps_bench_train_times(tmp_path):
    """A CPU run of the training loop: its summary's step time is the median of the per-step times (its metrics
    records) of exactly the steps bench_train's ``timed_steps`` times at its default warm-up, and its tokens/s and
    MFU are the benchmark's (tokens per step over that median). Before, the summary was the mean of every step
    after the first."""
    steps = WARMUP_STEPS + 3
    cfg = GalaxyConfig.from_dict(DEFAULT_BERT, {"plan": "none", "max_steps": steps, "global_batch_size": 4})
    ctx = ParallelContext.serial()
    metrics = tmp_path / "m.jsonl"
    batch_at, _ = mlm_data(cfg)
    result = train(build_base(cfg, cfg.resolve_plan(1), ctx), batch_at, cfg, ctx,
                   reporting=Reporting(metrics_file=str(metrics), peak_tflops=1.0))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = bench_timed_indices(WARMUP_STEPS, steps - WARMUP_STEPS)
    assert timed == [WARMUP_STEPS + 1, WARMUP_STEPS + 2, WARMUP_STEPS + 3]
    median = statistics.median(records[i - 1]["step_time_s"] for i in timed)
    assert result.step_time_s == median and result.timed_steps == len(timed)
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    assert result.tokens_per_s == pytest.approx(tokens / median, rel=1e-12)
    assert result.mfu == pytest.approx(tokens * model_flops_per_token(cfg, cfg.train.seq_length) / median / 1e12,
                                       rel=1e-12)
    assert result.mfu_causal == pytest.approx(
        tokens * causal_flops_per_token(cfg, cfg.train.seq_length) / median / 1e12, rel=1e-12)
    assert all(r["mfu_causal"] < r["mfu"] for r in records)  # every step's record states both
    fields = result.summary()
    assert fields["timed_steps"] == 3 and fields["mfu_causal"] == round(result.mfu_causal, 4)


def test_steady_state_leaves_out_the_warm_up_and_a_profiled_step():
    cfg = GalaxyConfig.from_dict(LLAMA_7B)
    steady = SteadyState(cfg, world_size=4, peak=PeakFlops(2e12, "test"))
    for i, seconds in enumerate([9.0, 5.0, 1.0, 3.0, 7.0, 2.0], 1):
        steady.add(seconds, 1000, 4096, skip=i == 4, bubble=float(i))
    assert steady.steady() == [3, 5, 6]
    summary = steady.summary()
    assert summary["step_time_s"] == 2.0 and summary["timed_steps"] == 3
    assert summary["tokens_per_s"] == 500.0 and summary["tokens_per_s_per_gpu"] == 125.0
    assert summary["mfu"] == pytest.approx(1000 * model_flops_per_token(cfg, 4096) / 2.0 / 4 / 2e12)
    assert steady.mean("bubble") == pytest.approx((3 + 5 + 6) / 3)
    short = SteadyState(cfg, 1, PeakFlops(None, "cpu"))  # no step after the warm-up: the last one stands
    short.add(4.0, 10, 8)
    short.add(6.0, 10, 8)
    assert short.steady() == [2] and short.summary()["step_time_s"] == 6.0 and short.summary()["mfu"] is None


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_causal_mfu_counts_half_the_attention_scores(tuning):
    """LLaMA-7B at seq 4096: 6 N + 12 L H S full, 6 N + 6 L H S causal (LoRA: 4 N + the same attention terms);
    the 4-GPU pick's 1,322.7 ms step (65,536 tokens on 4 H200s at 989.4 TFLOP/s) is MFU 0.577 by the first and
    0.537 by the second."""
    cfg = GalaxyConfig.from_dict(LLAMA_7B, {"tuning": tuning} if tuning != "full" else {})
    weights = model_matmul_weights(cfg)
    layers_hidden_seq = 32 * 4096 * 4096
    assert model_flops_per_token(cfg, 4096) == training_flops_per_token(weights, 4096, 4096, tuning)
    per_weight = 6 if tuning == "full" else 4
    assert causal_flops_per_token(cfg, 4096) == per_weight * weights.total + 6 * layers_hidden_seq
    if tuning == "full":
        peak = PeakFlops(989.4e12, "H200")
        steady = SteadyState(cfg, 4, peak)
        steady.add(1.3227, 65536, 4096)
        summary = steady.summary()
        assert round(summary["mfu"], 3) == 0.577 and round(summary["mfu_causal"], 3) == 0.537
