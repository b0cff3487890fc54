"""The metrics' ``comm_bytes`` (global rank 0's) count every collective of a training step: the
layout transitions, the loss, the PARTIAL gradient reductions (after backward, overlapped, or
reduce-scattered with the updated weights all-gathered), the dp buckets, ZeRO-1's broadcasts, the
gradient norm, and a pipeline's sends and tied-embedding sum. The expected bytes are derived here
from the serial model's parameter shapes and the plan, by docs/design.md's transition table, never read
from the Communicator."""

import json

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.models.bert import BertForMaskedLM
from galaxy.train.loop import train
from galaxy.train.options import Reporting
from galaxy.data.pretraining import mlm_data

BERT = dict(vocab_size=64, hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=40,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TRAIN = dict(seq_length=12, global_batch_size=8, lr=1e-3, dtype="float64", seed=3, max_steps=2, coc_parallel_num=1)
F64 = 8
IO = {"TP": ("T", "P"), "SP": ("S", "S"), "None": ("R", "R")}
# Collectives of one transition, forward + backward, in full activations (an all-gather counts its
# whole output, a reduce-scatter its whole input): docs/design.md section 1.
TRANSITION = {("P", "T"): 2, ("P", "R"): 1, ("P", "S"): 2, ("R", "T"): 1, ("R", "R"): 0, ("R", "S"): 1,
              ("S", "T"): 2, ("S", "R"): 1, ("S", "S"): 0}
PLANS = {"tp": ("TP", "None", "TP"), "sp": ("SP", "SP", "SP"), "galaxy": ("TP", "SP", "TP"),
         "galaxy2": ("TP", "SP", "SP")}


def block_of(name: str) -> str:
    """Which block of a BERT layer holds a serial parameter (embeddings and the head live in the stream)."""
    if ".attention.self." in name or ".attention.output.dense." in name:
        return "att"
    if "LayerNorm" in name and ".layer." in name:
        return "con"
    if ".intermediate." in name or ".output.dense." in name:
        return "mlp"
    return "stream"


def summed_over_mp(name: str, methods: dict) -> bool:
    """A whole weight used on a sequence shard, or a row-parallel bias added on one rank only."""
    method = methods[block_of(name)]
    row_bias = name.endswith("attention.output.dense.bias") or (name.endswith("output.dense.bias") and
                                                                  block_of(name) == "mlp")
    return method == "SP" or (method == "TP" and row_bias)


def local_numel(name: str, shape: torch.Size, methods: dict, mp: int) -> int:
    """Elements this mp rank holds (even splits): TP shards a block's weights, except row biases."""
    n = shape.numel()
    if methods[block_of(name)] == "TP" and not summed_over_mp(name, methods):
        return n // mp
    return n


def expected_step_bytes(plan: str, mp: int, dp: int, mode: str, zero1: bool, pp: int = 1) -> int:
    """Global rank 0's bytes of one step (it writes the metrics): with ``pp`` 2, the first stage (mp 1)."""
    if pp > 1:
        assert (plan, mp, dp, pp) == ("none", 1, 1, 2), "pipelines: derived for two stages of a serial plan"
        cfg = GalaxyConfig.from_dict(dict(BERT, **TRAIN))
        rows, seq, hidden = TRAIN["global_batch_size"], TRAIN["seq_length"], BERT["hidden_size"]
        return (rows * seq * hidden * F64  # every micro-batch's activations sent to stage 2 (receives not counted)
                + F64  # the loss broadcast from the last stage
                + F64  # the squared gradient norm summed over the stages
                + cfg.model.vocab_size * hidden * F64)  # the tied word embeddings' gradients summed by both ends
    att, con, mlp = PLANS[plan]
    methods = {"att": att, "con": con, "mlp": mlp, "stream": con}
    stream = IO[con][1]
    rows = TRAIN["global_batch_size"] // dp
    cfg = GalaxyConfig.from_dict(dict(BERT, **TRAIN))
    serial = {n: p.shape for n, p in BertForMaskedLM(cfg.model, seed=0).named_parameters()}
    activation = rows * TRAIN["seq_length"] * BERT["hidden_size"] * F64
    total = 0
    if mp > 1:
        per_layer = 0
        for method in (att, mlp):
            per_layer += TRANSITION[(stream, IO[method][0])] + TRANSITION[(IO[method][1], stream)]
        if att == "SP":  # K and V (2 x hidden per token) gathered along the sequence, reduce-scattered back
            per_layer += 2 * 2
        total += BERT["num_hidden_layers"] * per_layer * activation
        total += F64 if stream == "S" else 0  # the loss: each rank's sum over its tokens, all-reduced
        total += F64  # the squared norm of the TP shards' gradients, all-reduced
        partial = sum(shape.numel() for n, shape in serial.items() if summed_over_mp(n, methods)) * F64
        total += 2 * partial if mode == "sharded" else partial  # reduce-scatter + all-gather, or all-reduce
    if dp > 1:
        assert mode != "sharded", "the dp sum of a sharded bucket moves its piece: not derived here"
        total += 2 * F64  # the loss-target count and the reported loss, summed over dp
        grads = sum(local_numel(n, shape, methods, mp) for n, shape in serial.items()) * F64
        total += grads * (2 if zero1 else 1)  # the dp buckets; ZeRO-1 broadcasts every parameter it stepped
    return total


def measured_step_bytes(ctx, plan, mode, zero1, path):
    cfg = GalaxyConfig.from_dict(dict(BERT, **TRAIN), {"plan": plan, "mp_grad_reduce": mode,
                                                       "dp_size": ctx.dp.size, "pp_size": ctx.pp.size,
                                                       "num_microbatches": ctx.pp.size,
                                                       "dp_engine": "zero1" if zero1 else "ddp"})
    ctx.stage_layers = cfg.stage_layers()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=0)
    train(model, mlm_data(cfg)[0], cfg, ctx, reporting=Reporting(metrics_file=path))
    return True


CASES = [  # plan, mp, dp, mode, zero1, pp
    ("tp", 2, 1, "after_backward", False, 1),
    ("sp", 2, 1, "sharded", False, 1),
    ("galaxy", 3, 1, "overlap", False, 1),
    ("galaxy2", 2, 1, "sharded", False, 1),
    ("galaxy2", 2, 2, "overlap", True, 1),
    ("none", 1, 1, "after_backward", False, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-mp{c[1]}-dp{c[2]}-pp{c[5]}-{c[3]}" + ("-zero1" if c[4] else "")
                                             for c in CASES])
def test_metrics_comm_bytes_count_every_collective_of_a_step(dist_pool, tmp_path, case):
    plan, mp, dp, mode, zero1, pp = case
    path = str(tmp_path / "metrics.jsonl")
    dist_pool.run(measured_step_bytes, mp * dp * pp, plan, mode, zero1, path, dp=dp, pp=pp)
    records = [json.loads(line) for line in open(path)]
    assert len(records) == TRAIN["max_steps"]
    want = expected_step_bytes(plan, mp, dp, mode, zero1, pp)
    assert [r["comm_bytes"] for r in records] == [want] * len(records), (want, records)


def transition_records_under_bf16_autocast(ctx, plan):
    """(op, bytes, phase) of every mp collective of a LLaMA forward + backward under bf16 autocast
    over fp32 parameters (dtype bfloat16: the residual stream and the norms' outputs stay fp32)."""
    from galaxy.data.pretraining import causal_lm_data
    from galaxy.models import build_model
    from galaxy.train.loop import Trainer

    cfg = GalaxyConfig.from_dict({"model": {"preset": "llama-tiny"}, "parallel": {"plan": plan},
                                  "train": {"global_batch_size": 2, "seq_length": 16, "dtype": "bfloat16"}})
    trainer = Trainer(build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx), cfg, ctx)
    records = []
    ctx.mp.observers.append(records.append)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trainer.forward_backward(trainer.read_batch(causal_lm_data(cfg)[0], 0))
    finally:
        ctx.mp.observers.remove(records.append)
    return [(r.op, r.nbytes, r.phase) for r in records], (cfg.model.hidden_size, cfg.model.num_hidden_layers)


@pytest.mark.parametrize("plan", ["galaxy", "tp"])
def test_transitions_move_the_compute_dtype_under_autocast(dist_pool, plan):
    """Every transition, into a block and out of it, forward and backward, moves 2 bytes an element
    under bf16 autocast, as the planner charges (Workload.elem) and Megatron's bf16 collectives move:
    the fp32 stream is cast before the entry collective, not after it."""
    records, (hidden, layers) = dist_pool.run(transition_records_under_bf16_autocast, 2, plan)[0]
    activation = 2 * 16 * hidden * 2  # rows x seq x hidden, bf16
    att, con, mlp = PLANS[plan]
    stream = IO[con][1]
    per_layer = sum(TRANSITION[(stream, IO[m][0])] + TRANSITION[(IO[m][1], stream)] for m in (att, mlp))
    moved = [r for r in records if r[1] > 4]  # the loss's fp32 scalar rides along
    assert len(moved) == per_layer * layers, records
    assert all(nbytes == activation for _, nbytes, _ in moved), records
