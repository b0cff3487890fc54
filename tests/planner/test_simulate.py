"""galaxy.planner.simulate: a plan's predicted step. Its bytes equal tests/core/test_comm_bytes.py's
derivation, its peak follows the real Trainer's gradients, the tied embeddings' sum crosses between stages,
work moves to the fast rank, and the pipeline bubble is the schedule's."""

import dataclasses

import numpy as np
import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.planner.cluster import AlphaBeta, Curve, Piece
from galaxy.planner.profile import model_params
from galaxy.planner.simulate import predict
from galaxy.planner.workload import Layout, Splits, Workload
from tests.core.test_comm_bytes import CASES as COMM_BYTES_CASES
from tests.planner.helpers import BERT, LLAMA, NONE, SP, TP, synthetic_cluster


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
