"""The SP attention flavours (config key ``sp_attention``: allgather, ring, ulysses; galaxy.core.sp_attention).

Each flavour equals the serial model in float64 through the existing equivalence harnesses: loss, outputs
and every parameter gradient (BERT also the parameters after AdamW steps), at world 2, 3 and 4, even and
uneven splits, causal LLaMA with GQA (the ring in the zigzag order) and BERT (non-causal), both with key
padding masks (every flavour supports them), on the SP plan and the Galaxy-style plans whose ATT is SP, with
LoRA, selective and full recomputation, composed with dp (dp 2 x mp 2) and pp (pp 2 x mp 2); generation,
evaluation and compiled layers (the ring running eagerly inside them) too. The ring's point-to-point bytes
and Ulysses' all-to-all bytes equal the count derived here from the shapes; the attention FLOPs of every
flavour are torch's FlopCounterMode's, and those of BERT equal the allgather flavour's. Plus the pieces: the
zigzag order, the ring's block pairs (every visible key once, equal work per step), the block attention with
its log-sum-exp."""

import math

import pytest
import torch
import torch.nn.functional as F

from galaxy.config import ConfigError, GalaxyConfig, Method, Plan
from galaxy.core.attention import attention
from galaxy.core.sp_attention import (_block_pairs, _merge, _pair_mask, attend_block, attend_block_backward,
                                      load_balanced)
from galaxy.core.transitions import SequenceOrder
from tests.core import test_dp_pp as dp_pp
from tests.core import test_equivalence as bert_eq
from tests.core import test_llama_equivalence as llama_eq

FLAVOURS = ("ring", "ulysses")


# ----------------------------------------------------------------------------- the zigzag order


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_holds_chunks_r_and_2n_minus_1_minus_r(world):
    chunk = 3
    order = SequenceOrder([2 * chunk] * world, zigzag=True)
    for r in range(world):
        want = [r * chunk + i for i in range(chunk)] + [(2 * world - 1 - r) * chunk + i for i in range(chunk)]
        assert order.positions(r).tolist() == want
    seq = torch.arange(2 * chunk * world)[None]
    stream = order.to_stream_order(seq)
    assert stream[0].tolist() == torch.cat([order.positions(r) for r in range(world)]).tolist()
    assert torch.equal(order.to_natural_order(stream), seq)


def test_uneven_zigzag_cuts_each_share_into_a_front_and_a_back_half():
    order = SequenceOrder([2, 5, 4], zigzag=True)  # fronts 1, 3, 2 from the start; backs 1, 2, 2 from the end
    assert [order.positions(r).tolist() for r in range(3)] == [[0, 10], [1, 2, 3, 8, 9], [4, 5, 6, 7]]
    single = SequenceOrder([1, 3], zigzag=True)  # a share of one token has no back half
    assert single.pieces == (((0, 1),), ((1, 2), (3, 1)))
    x = torch.randn(2, 4, 3)
    assert torch.equal(single.to_natural_order(single.to_stream_order(x)), x)
    assert SequenceOrder([2, 5, 4]).positions(1).tolist() == [2, 3, 4, 5, 6]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
    return (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)


@pytest.mark.parametrize("split,zigzag", [((4, 4, 4), True), ((2, 5, 4), True), ((3, 1, 4, 2), True),
                                          ((2, 5, 4), False), ((6, 6), False)])
@pytest.mark.parametrize("causal", [True, False])
def test_block_pairs_cover_every_visible_key_once(split, zigzag, causal):
    order = SequenceOrder(split, zigzag=zigzag)
    for r in range(len(split)):
        for src in range(len(split)):
            q_pos, k_pos = order.positions(r), order.positions(src)
            covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
            for pair in _block_pairs(order.pieces[r], order.pieces[src], causal):
                q_at, q_len, k_at, k_len, kind = pair
                mask = _pair_mask(pair, order.pieces[r], order.pieces[src], None, "cpu")
                area = torch.ones(q_len, k_len, dtype=torch.bool)
                if kind == "causal":
                    area = torch.ones(q_len, k_len, dtype=torch.bool).tril()
                if mask is not None:
                    area = area & mask[0, 0]
                covered[q_at:q_at + q_len, k_at:k_at + k_len] += area
            assert torch.equal(covered, visible(q_pos, k_pos, causal).long()), (r, src)


def work_per_step(order: SequenceOrder, world: int) -> list[list[int]]:
    """Visible (query, key) pairs of each rank at each ring step (rank r holds rank r - step's block)."""
    return [[int(visible(order.positions(r), order.positions((r - step) % world), True).sum())
             for r in range(world)] for step in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_gives_every_rank_the_same_causal_work_at_every_step(world):
    zigzag = work_per_step(SequenceOrder([8] * world, zigzag=True), world)
    assert all(len(set(step)) == 1 for step in zigzag), zigzag
    contiguous = work_per_step(SequenceOrder([8] * world), world)
    assert any(len(set(step)) > 1 for step in contiguous), "the contiguous order is unbalanced"


# ----------------------------------------------------------------------------- one block and its log-sum-exp


def test_blocks_merged_by_their_lse_equal_attention_forward_and_backward():
    """Queries over three key blocks (GQA, key padding with a row that sees no key, causal boundaries
    inside blocks), merged by the blocks' log-sum-exp: the output, the log-sum-exp and the gradients
    of one attention over every key, float64 to 1e-12."""
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, seq, d = 2, 4, 2, 10, 8
    q, k, v = (torch.randn(b, h, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    keep = torch.ones(b, seq, dtype=torch.bool)
    keep[1, :4] = False  # row 1's first queries see no key under the causal mask
    want = attention(q, k, v, key_padding_mask=keep, causal=True)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad(want, (q, k, v), grad)
    scale = 1 / math.sqrt(d)
    out = torch.zeros_like(want)
    lse = torch.full(want.shape[:3], float("-inf"), dtype=torch.float64)
    pos = torch.arange(seq)
    blocks = [(0, 3), (3, 4), (7, 3)]
    masks = []
    for start, n in blocks:
        mask = (pos[None, start:start + n] <= pos[:, None])[None, None] & keep[:, None, None, start:start + n]
        masks.append(mask)
        o, s = attend_block(q.detach(), k.detach()[:, :, start:start + n], v.detach()[:, :, start:start + n],
                            mask=mask, scale=scale)
        _merge(out, lse, o, s)
    assert (out - want).abs().max() < 1e-12
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    allowed = (pos[None, :] <= pos[:, None])[None, None] & keep[:, None, None, :]
    assert torch.allclose(lse, scores.masked_fill(~allowed, float("-inf")).logsumexp(-1), rtol=0, atol=1e-12)
    assert torch.isneginf(lse[1, :, :4]).all() and (out[1, :, :4] == 0).all()
    got_q, got_k, got_v = torch.zeros_like(dq), torch.zeros_like(dk), torch.zeros_like(dv)
    for (start, n), mask in zip(blocks, masks):
        gq, gk, gv = attend_block_backward(grad, q.detach(), k.detach()[:, :, start:start + n],
                                           v.detach()[:, :, start:start + n], out, lse, mask=mask, scale=scale)
        got_q += gq
        got_k[:, :, start:start + n] += gk
        got_v[:, :, start:start + n] += gv
    for got, ref in ((got_q, dq), (got_k, dk), (got_v, dv)):
        assert (got - ref).abs().max() < 1e-12


def test_a_diagonal_block_is_causal_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = attend_block(q, k, v, causal=True, scale=0.5)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5), atol=1e-14)
    assert torch.allclose(lse, ((q @ k.transpose(-1, -2)) * 0.5).masked_fill(
        torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1), atol=1e-14)


# ----------------------------------------------------------------------------- equal to the serial model

GQA_BELOW_RANKS = dict(num_key_value_heads=2)  # 2 kv heads for 4 ranks: Ulysses sends each to two ranks
LLAMA_CASES = [  # plan, world, uneven splits, extra config
    ("sp", 2, False, {}),
    ("sp", 3, False, {}),  # Ulysses: heads [3, 3, 2], a GQA group split over ranks 0 and 1
    ("sp", 3, True, {}),  # seq [2, 5, 4] (zigzag halves 1+1, 3+2, 2+2), heads [2, 4, 2]
    ("sp", 4, False, GQA_BELOW_RANKS),
    ("sp", 4, True, {}),
    (("SP", "None", "TP"), 2, True, {}),  # the stream replicated: ATT.sp between a split and an all-gather
    (("SP", "SP", "TP"), 3, False, {}),
]


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("plan,world,uneven,extra", LLAMA_CASES,
                         ids=[f"{'-'.join(p) if isinstance(p, tuple) else p}-w{w}{'-uneven' if u else ''}"
                              f"{'-kv2' if e else ''}" for p, w, u, e in LLAMA_CASES])
def test_llama_equals_serial(dist_pool, flavour, plan, world, uneven, extra):
    dist_pool.run(llama_eq.compare_with_serial, world, plan, uneven, dict(extra, sp_attention=flavour))


BERT_CASES = [(("SP", "SP", "SP"), 2, False), (("SP", "SP", "SP"), 3, True), (("SP", "SP", "SP"), 4, False),
              (("SP", "SP", "SP"), 4, True), (("SP", "None", "TP"), 3, True), (("SP", "SP", "TP"), 2, False)]


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("methods,world,uneven", BERT_CASES,
                         ids=[f"{'-'.join(m)}-w{w}{'-uneven' if u else ''}" for m, w, u in BERT_CASES])
def test_bert_equals_serial(dist_pool, flavour, methods, world, uneven):
    """Non-causal, a padded row's keys masked; the parameters after one AdamW step too."""
    dist_pool.run(bert_eq.compare_with_serial, world, methods, uneven, False, 1, "cls", dict(sp_attention=flavour))


@pytest.mark.parametrize("flavour,recompute", [("ring", "full"), ("ring", "selective"), ("ulysses", "selective"),
                                               ("ulysses", "full")])
def test_recomputed_equals_serial(dist_pool, flavour, recompute):
    dist_pool.run(llama_eq.compare_with_serial, 3, "sp", True, dict(sp_attention=flavour, recompute=recompute))


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_lora_equals_serial(dist_pool, model_type, flavour):
    from tests.peft import test_peft_equivalence as peft_eq

    dist_pool.run(peft_eq.compare_with_serial, 3, model_type, "lora", "sp", True, dict(sp_attention=flavour))


DP_PP_CASES = {  # ATT SP; an MLP TP under dp, whose weights' dp buckets go while backward runs (test_dp_pp checks)
    "llama-dp2-mp2": dict(model="llama", dp_size=2, att_parallel_method="SP", con_parallel_method="SP",
                          mlp_parallel_method="TP"),
    "llama-pp2-sp2": dict(model="llama", pp_size=2, plan="sp", num_microbatches=2),
    "bert-pp2-sp2": dict(pp_size=2, plan="sp", num_microbatches=2, pipeline_engine="galaxy"),
}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("name", sorted(DP_PP_CASES))
def test_dp_and_pp_around_the_flavour_equal_serial(dist_pool, name, flavour):
    """3 clipped AdamW steps, every gradient and parameter as the serial model's (test_dp_pp's harness)."""
    case = dict(DP_PP_CASES[name], sp_attention=flavour)
    dist_pool.run(dp_pp.compare_with_serial, 4, case, dp=case.get("dp_size", 1), pp=case.get("pp_size", 1))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_generation_prefills_with_allgather_and_equals_serial(dist_pool, flavour):
    """The KV cache's prefill gathers K and V in the natural order whatever the flavour (the zigzag order is
    the training forward's): greedy tokens as the serial model's."""
    dist_pool.run(llama_eq.generate_on_sp_plan, 3, "sp", True, dict(sp_attention=flavour))


def test_evaluation_in_the_zigzag_order_equals_serial(dist_pool):
    """Held-out loss and next-token accuracy: the labels follow the stream's zigzag order."""
    from tests.train import test_evaluate as eval_t

    expected = eval_t.direct("llama")
    for got in dist_pool.run(eval_t.evaluate_in_layout, 3, "llama", {"plan": "sp", "sp_attention": "ring"}):
        assert got["eval_targets"] == expected["eval_targets"]
        for key in expected:
            assert abs(got[key] - expected[key]) <= 1e-9 * abs(expected[key]), (key, got, expected)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_compiled_layer_equals_eager(dist_pool, flavour):
    """Ulysses' all-to-alls are functional collectives: a compiled layer traces them without a graph break.
    The ring's point-to-point exchanges do not trace: the layer compiles around the ring, which runs eagerly."""
    from tests.core import test_compile

    dist_pool.run(test_compile.compiled_equals_eager, 2, "llama", "sp", False, torch.float32,
                  dict(sp_attention=flavour), "ring_attention" if flavour == "ring" else None)


# ----------------------------------------------------------------------------- bytes


def head_spans(heads: int, kv_heads: int, split) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank: its query heads (start, count) and the kv heads they read (start, count)."""
    group, out, start = heads // kv_heads, [], 0
    for n in split:
        first, last = start // group, (start + n - 1) // group
        out.append(((start, n), (first, last - first + 1)))
        start += n
    return out


def recorded_bytes(ctx, flavour, uneven):
    serial, par = llama_eq.build(ctx, "sp", uneven, dict(sp_attention=flavour))
    records = []
    ctx.mp.observers.append(records.append)
    try:
        par(**llama_eq.make_batch()).loss.backward()
    finally:
        ctx.mp.observers.remove(records.append)
    plan = par.plan
    return [(r.op, r.phase, r.nbytes) for r in records if r.op in ("send_recv", "all_to_all")], \
        (plan.seq_split, plan.heads_split)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("world,uneven", [(2, False), (3, True), (4, False)])
def test_ring_and_all_to_all_bytes_equal_the_analytic_count(dist_pool, flavour, world, uneven):
    """Per rank and layer. Ring: forward, N-1 K/V blocks (every block but rank r+1's); backward, N-1 K/V
    blocks again (every block but rank r-1's) and the N dK/dV accumulators (every block's, in float64 as
    the model). Ulysses, forward: q, k and v of this rank's tokens (each rank's kv heads for its query
    heads: a kv head read by two ranks goes to both), then the output of its heads over the whole
    sequence; backward the same two, mirrored."""
    t = llama_eq.TINY
    b, d, heads, kv_heads, layers = llama_eq.BATCH, t["hidden_size"] // t["num_attention_heads"], \
        t["num_attention_heads"], t["num_key_value_heads"], t["num_hidden_layers"]
    f64 = 8
    for r, (records, (seq, head_split)) in enumerate(dist_pool.run(recorded_bytes, world, flavour, uneven)):
        n, total = world, sum(seq)
        kv = [b * kv_heads * s * 2 * d * f64 for s in seq]  # one rank's K/V block
        if flavour == "ring":
            want = {("send_recv", "fwd"): sum(kv) - kv[(r + 1) % n],
                    ("send_recv", "bwd"): sum(kv) - kv[(r - 1) % n] + sum(kv)}
        else:
            spans = head_spans(heads, kv_heads, head_split)
            (_, mine), (_, kv_mine) = spans[r]
            qkv_in = b * seq[r] * d * (heads + 2 * sum(c for _, (_, c) in spans)) * f64
            out_back = b * mine * total * d * f64
            want = {("all_to_all", "fwd"): qkv_in + out_back,
                    ("all_to_all", "bwd"): b * heads * seq[r] * d * f64 + b * total * d * (mine + 2 * kv_mine) * f64}
        got = {}
        for op, phase, nbytes in records:
            got[(op, phase)] = got.get((op, phase), 0) + nbytes
        assert got == {key: layers * value for key, value in want.items()}, (r, got, want)


# ----------------------------------------------------------------------------- FLOPs


def attention_flops(ctx, model_type, flavour):
    """(galaxy's profiler total, FlopCounterMode's total, attention FLOPs) of one forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from galaxy.profiler import FlopsProfiler, extra_flop_formulas

    if model_type == "llama":
        serial, par = llama_eq.build(ctx, "sp", False, dict(sp_attention=flavour))
        batch = {k: v for k, v in llama_eq.make_batch().items() if k != "attention_mask"}
    else:
        raw = dict(bert_eq.TINY, plan="sp", seq_length=bert_eq.SEQ, sp_attention=flavour)
        cfg = GalaxyConfig.from_dict(raw)
        from galaxy.models.bert import BertForMaskedLM

        par = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=7).double()
        batch = bert_eq.make_batch(0)
    prof = FlopsProfiler(par)
    with prof, FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
        par(**batch).loss.backward()
    linear = sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    return prof.get_total_flops(), counter.get_total_flops(), counter.get_total_flops() - linear


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_flavours_count_attention_flops_as_flop_counter_mode(dist_pool, model_type):
    """Every flavour's FLOPs are torch's FlopCounterMode's on the same run (the ring's blocks through their
    matmuls or flash kernels, Ulysses' through SDPA). BERT's attention FLOPs (non-causal) are the same in every
    flavour over the group; LLaMA's causal ring skips the blocks that its masks hide entirely, so it counts
    fewer than allgather's and Ulysses' masked full-sequence attention."""
    totals = {}
    for flavour in ("allgather",) + FLAVOURS:
        out = dist_pool.run(attention_flops, 2, model_type, flavour)
        assert all(profiled == counted > 0 for profiled, counted, _ in out), out
        totals[flavour] = sum(att for _, _, att in out)
    if model_type == "bert":
        assert totals["ring"] == totals["ulysses"] == totals["allgather"], totals
    else:
        assert totals["ring"] < totals["allgather"] == totals["ulysses"], totals


# ----------------------------------------------------------------------------- configuration


def test_config_refuses_what_the_flavours_cannot_do():
    base = dict(llama_eq.TINY, seq_length=llama_eq.SEQ)
    with pytest.raises(ConfigError, match="config key 'sp_attention': 'rings' is not one of allgather, ring, ulysses"):
        GalaxyConfig.from_dict(dict(base, plan="sp", sp_attention="rings"))
    with pytest.raises(ConfigError, match="sp_attention' is 'ring', which chooses how an SP attention block attends, "
                                          "but att_parallel_method is TP"):
        GalaxyConfig.from_dict(dict(base, plan="galaxy", sp_attention="ring"))
    with pytest.raises(ConfigError, match="ring attends block by block without attention dropout"):
        GalaxyConfig.from_dict(dict(base, plan="sp", sp_attention="ring", attention_probs_dropout_prob=0.1))
    cfg = GalaxyConfig.from_dict(dict(base, plan="sp", sp_attention="ulysses", num_attention_heads=2,
                                      num_key_value_heads=1, hidden_size=8))
    with pytest.raises(ConfigError, match="there are 2 heads for 3 ranks"):
        cfg.resolve_plan(3)
    assert cfg.resolve_plan(2).heads_split == (1, 1)
    uneven = GalaxyConfig.from_dict(dict(base, plan="sp", sp_attention="ulysses", tp_num_attention_heads_list=[5, 3]))
    assert uneven.resolve_plan(2).heads_split == (5, 3)  # Ulysses' head split, GQA groups may straddle ranks
    assert GalaxyConfig.from_dict(dict(base, plan="sp")).resolve_plan(2).sp_attention == "allgather"


def test_the_zigzag_order_is_causal_ring_attention_on_an_sp_attention_block():
    def plan(att, flavour, size=2):
        return Plan(att, Method.SP, Method.SP, (8,) * size, (8,) * size, (4,) * size, sp_attention=flavour)

    assert load_balanced(plan(Method.SP, "ring"), causal=True)
    assert not load_balanced(plan(Method.SP, "ring"), causal=False)  # BERT: contiguous ring
    assert not load_balanced(plan(Method.SP, "ulysses"), causal=True)
    assert not load_balanced(plan(Method.SP, "ring", 1), causal=True)


def side_tuned_ring(ctx):
    from galaxy.peft import apply_tuning

    cfg = GalaxyConfig.from_dict(dict(llama_eq.TINY, seq_length=llama_eq.SEQ, plan="sp", sp_attention="ring",
                                      tuning="side"))
    from galaxy.models.llama import LlamaForCausalLM

    with pytest.raises(ConfigError, match="side network attends in the natural token order"):
        apply_tuning(LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=1), cfg)
    return True


def test_side_tuning_refuses_the_zigzag_order(dist_pool):
    assert all(dist_pool.run(side_tuned_ring, 2))


def test_the_profiler_names_each_flavours_exchanges():
    from galaxy.profiler import transition_label

    def plan(flavour):
        return Plan(Method.SP, Method.SP, Method.SP, (4, 4), (8, 8), (6, 6), sp_attention=flavour)

    assert transition_label("all_gather", "fwd", plan("allgather")) == "S->T (ATT.sp K/V gather)"
    assert transition_label("send_recv", "bwd", plan("ring")) == "ATT.sp ring attention"
    assert transition_label("all_to_all", "fwd", plan("ulysses")) == "ATT.sp ulysses attention"
    assert transition_label("all_gather", "fwd", plan("ring")) == "not a transition of this plan"
