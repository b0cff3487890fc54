"""What a run shows its user about its speed (``galaxy.train.metrics``): model FLOPs per token against torch's
FLOP counter, the devices' peak FLOPs, tokens/s per GPU and MFU in the metrics and the summary."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from galaxy.cli.finetune import DEFAULT_LLAMA
from galaxy.cli.pretrain import DEFAULT_BERT
from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.data.pretraining import mlm_data
from galaxy.data.instruction import InstructionBatcher, load_instruction_data
from galaxy.data.tokenizer import ByteTokenizer
from galaxy.peft import apply_tuning, build_base
from galaxy.profiler import ATTENTION_OPS, extra_flop_formulas
from galaxy.profiler.model_flops import training_flops_per_token
from galaxy.train.metrics import model_flops_per_token, model_matmul_weights
from galaxy.train.finetune import DEFAULT_DATA, instruction_batches, match_vocab
from galaxy.train.loop import train
from galaxy.train.options import Reporting
from galaxy.train.metrics import peak_flops_per_device


DEFAULTS = {"bert": DEFAULT_BERT, "llama": DEFAULT_LLAMA}


def counted_step(cfg: GalaxyConfig, rows: int, seq: int) -> tuple[int, int]:
    """FlopCounterMode (with the profiler's formulas) on one real forward + backward of the serial
    model: (all FLOPs, FLOPs of the fused attention kernels' forward)."""
    model = apply_tuning(build_base(cfg, cfg.resolve_plan(1), ParallelContext.serial()), cfg).train()
    ids = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = counter.get_flop_counts()["Global"]
    fused_forward = sum(v for op, v in counts.items() if op in ATTENTION_OPS and not str(op).endswith("backward"))
    return counter.get_total_flops(), fused_forward


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_training_flops_equal_the_flop_counter_on_a_real_step(model_type):
    cfg = GalaxyConfig.from_dict(DEFAULTS[model_type], {"plan": "none"})
    rows, seq = 3, 40  # S != H, rows != layers: a swapped factor shows
    counted, fused_forward = counted_step(cfg, rows, seq)
    # Fused attention backward recomputes Q K^T (half of its forward), hardware FLOPs that model FLOPs leave out.
    assert counted - fused_forward // 2 == model_flops_per_token(cfg, seq) * rows * seq


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_matmul_weights_are_the_models_own_matrices(model_type):
    cfg = GalaxyConfig.from_dict(DEFAULTS[model_type], {"plan": "none"})
    model = build_base(cfg, cfg.resolve_plan(1), ParallelContext.serial())
    lookups_only = ("position_embeddings", "token_type_embeddings", "embed_tokens")  # BERT's word embeddings
    # are its tied MLM decoder; LLaMA-tiny's lm_head is its own matrix
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and not any(k in name for k in lookups_only))
    assert model_matmul_weights(cfg).total == matrices


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_lora_flops_are_close_to_the_flop_counter(model_type):
    cfg = GalaxyConfig.from_dict(DEFAULTS[model_type], {"plan": "none", "tuning": "lora"})
    rows, seq = 2, 48
    counted, fused_forward = counted_step(cfg, rows, seq)
    formula = model_flops_per_token(cfg, seq) * rows * seq
    assert formula == pytest.approx(counted - fused_forward // 2, rel=0.05)
    full = training_flops_per_token(model_matmul_weights(cfg), cfg.model.hidden_size, seq, "full")
    assert formula < 0.75 * full * rows * seq  # no weight gradients of the base


def test_peak_flops_come_from_the_flag_the_table_or_nowhere(monkeypatch):
    cpu = peak_flops_per_device(torch.device("cpu"), "float32")
    assert cpu.flops_per_s is None and "--peak_tflops" in cpu.source
    assert peak_flops_per_device(torch.device("cpu"), "float32", 2.5).flops_per_s == 2.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert peak_flops_per_device(gpu, "bfloat16").flops_per_s == pytest.approx(989.4e12)
    tf32 = torch.backends.cuda.matmul.allow_tf32  # set and restored by hand: torch 2.11's cuBLASModule has
    torch.backends.cuda.matmul.allow_tf32 = False  # no attribute monkeypatch can restore (it deletes it)
    try:
        assert peak_flops_per_device(gpu, "float32").flops_per_s == pytest.approx(66.9e12)
        assert peak_flops_per_device(gpu, "float64").flops_per_s is None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops_per_device(gpu, "bfloat16").flops_per_s == pytest.approx(312e12)


def finetune_run(tmp_path, peak_tflops):
    cfg = GalaxyConfig.from_dict(DEFAULT_LLAMA, {"plan": "none", "max_steps": 3, "global_batch_size": 2})
    tokenizer = ByteTokenizer()
    match_vocab(cfg, tokenizer)
    batcher = InstructionBatcher(load_instruction_data(DEFAULT_DATA), tokenizer, cfg.train.seq_length,
                                 cfg.train.global_batch_size, seed=cfg.train.seed)
    ctx = ParallelContext.serial()
    model = build_base(cfg, cfg.resolve_plan(1), ctx)
    metrics = tmp_path / "m.jsonl"
    batch_at = instruction_batches(batcher)
    result = train(model, batch_at, cfg, ctx, reporting=Reporting(metrics_file=str(metrics), peak_tflops=peak_tflops))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return cfg, batch_at, result, records


def test_mfu_follows_each_steps_own_sequence_length(tmp_path):
    cfg, batch_at, result, records = finetune_run(tmp_path, peak_tflops=0.25)
    lengths = [batch_at(i)["input_ids"].shape[-1] for i in range(3)]
    assert len(set(lengths)) > 1  # rows are padded to their longest example: the steps differ
    for record, seq in zip(records, lengths):
        assert record["tokens_per_s_per_gpu"] == record["tokens_per_s"]  # one rank
        achieved = record["mfu"] * 0.25e12 / record["tokens_per_s_per_gpu"]
        assert achieved == pytest.approx(model_flops_per_token(cfg, seq))
    fields = result.summary()
    assert fields["peak_tflops"] == 0.25 and fields["mfu"] > 0 and "mfu_note" not in fields


def test_cpu_without_a_peak_reports_no_mfu_and_says_why(tmp_path):
    cfg = GalaxyConfig.from_dict(DEFAULT_BERT, {"plan": "none", "max_steps": 2, "global_batch_size": 4})
    assert cfg.train.peak_tflops is None
    ctx = ParallelContext.serial()
    metrics = tmp_path / "m.jsonl"
    batch_at, _ = mlm_data(cfg)
    result = train(build_base(cfg, cfg.resolve_plan(1), ctx), batch_at, cfg, ctx,
                   reporting=Reporting(metrics_file=str(metrics)))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 2 and all(r["mfu"] is None and r["tokens_per_s_per_gpu"] > 0 for r in records)
    fields = result.summary()
    assert fields["mfu"] is None and fields["peak_tflops"] is None
    assert "--peak_tflops" in fields["mfu_note"]
