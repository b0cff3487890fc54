"""Async TP (galaxy.core.overlap.async_tp, config ``tp_overlap: async_tp``).

On CPU/Gloo the autograd of both edges runs over torch's own unfused definitions of the fused ops
(``reference_ops``: functional collectives + matmul, the ops' Meta kernels) and equals the path it
replaces, ``transition`` + ``F.linear``, in float64 at world 2 and 3 with uneven weight shards and
batch 1 and 2: outputs, input/weight/bias gradients (the row-parallel bias summed over the group,
as its PARTIAL rule does) and the bytes counted; through the model's edges (AsyncTpEdge), LLaMA
galaxy/galaxy2 with and without fused_gate_up equals the serial model (fp64, every gradient). torch's
real symm_mem kernels need CUDA + NCCL: bench/device/asynctp_check.py runs them on a GPU. Also: each
refusal is one ConfigError line, and an mp group of one keeps its edges unfused.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.transitions import Layout, transition
from galaxy.core.overlap.async_tp import AsyncTpEdges, reference_ops

RTOL = 1e-12
H, OUT, SHARD = 6, 5, 3  # hidden width; row-parallel output width; tokens per rank


def _randn(shape, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _run(fn, inputs, grad_outputs):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    ys = fn(*leaves)
    ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
    torch.autograd.backward(ys, grad_outputs)
    return [y.detach() for y in ys], [None if t is None else t.grad for t in leaves]


def _close(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= RTOL * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def column_case(ctx, batch):
    """S -> T + q/k/v-like column linears (one without bias) vs transition + F.linear."""
    comm, r = ctx.mp, ctx.mp.rank
    own, split = torch.Generator().manual_seed(100 + r), (SHARD,) * comm.size
    widths = (2 + r % 3, 1 + r, 3)  # uneven column shards
    x = _randn((batch, SHARD, H), own)
    params = [_randn((w, H), own) for w in widths] + [_randn((widths[0],), own), None, _randn((widths[2],), own)]
    grads = [_randn((batch, SHARD * comm.size, w), own) for w in widths]
    edges = AsyncTpEdges(comm, reference_ops())

    def reference(x, *p):
        full = transition(x, Layout.S, Layout.T, comm, split)
        return [F.linear(full, w, b) for w, b in zip(p[:3], p[3:])]

    sent = comm.bytes_sent
    (y1, g1) = _run(lambda x, *p: edges.enter(x, p[:3], p[3:]), [x, *params], grads)
    fused_bytes, sent = comm.bytes_sent - sent, comm.bytes_sent
    (y0, g0) = _run(reference, [x, *params], grads)
    assert fused_bytes == comm.bytes_sent - sent, (fused_bytes, comm.bytes_sent - sent)
    for i, (a, b) in enumerate(zip(y1, y0)):
        _close(a, b, f"rank {r} b={batch} output {i}")
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert (a is None) == (b is None), i
        if a is not None:
            _close(a, b, f"rank {r} b={batch} grad of input {i}")
    return True


def row_case(ctx, batch):
    """Row-parallel linear + P -> S vs F.linear (bias on rank 0) + transition."""
    comm, r = ctx.mp, ctx.mp.rank
    shared, own = torch.Generator().manual_seed(7), torch.Generator().manual_seed(200 + r)
    split, width = (SHARD,) * comm.size, 2 + r  # uneven row shards
    x = _randn((batch, SHARD * comm.size, width), own)
    weight, bias = _randn((OUT, width), own), _randn((OUT,), shared)  # the bias is replicated
    grad = [_randn((batch, SHARD, OUT), own)]
    edges = AsyncTpEdges(comm, reference_ops())

    def reference(x, w, b):
        return transition(F.linear(x, w, b if r == 0 else None), Layout.P, Layout.S, comm, split)

    sent = comm.bytes_sent
    (y1,), (gx1, gw1, gb1) = _run(edges.leave, [x, weight, bias], grad)
    fused_bytes, sent = comm.bytes_sent - sent, comm.bytes_sent
    (y0,), (gx0, gw0, gb0) = _run(reference, [x, weight, bias], grad)
    assert fused_bytes == comm.bytes_sent - sent, (fused_bytes, comm.bytes_sent - sent)
    _close(y1, y0, f"rank {r} b={batch} output")
    _close(gx1, gx0, f"rank {r} b={batch} grad x")
    _close(gw1, gw0, f"rank {r} b={batch} grad weight")
    # PARTIAL rule: the bias gradient is right once summed over the group (each rank holds its tokens' share).
    gb0 = torch.zeros_like(gb1) if gb0 is None else gb0
    for g in (gb1, gb0):
        dist.all_reduce(g, group=comm.process_group)
    _close(gb1, gb0, f"rank {r} b={batch} grad bias (summed)")
    return True


def model_case(ctx, plan, fused_gate_up):
    """The model's edges (AsyncTpEdge) on torch's reference ops equal the serial
    model: loss, logits and every gradient (fp64), uneven heads/ffn shards, even sequence shards."""
    from galaxy.core.edges import LayerEdges, PlainEdge
    from galaxy.core.grad_sync import gather_full
    from galaxy.core.overlap.edges import AsyncTpEdge, async_tp_edge, plain_operands
    from galaxy.models.llama import LlamaForCausalLM
    from tests.core.test_llama_equivalence import RTOL as MODEL_RTOL
    from tests.core.test_llama_equivalence import TINY, UNEVEN, backward_both, rel_err

    seq = 12
    splits = {k: v for k, v in UNEVEN[ctx.mp.size].items() if k != "seq_scatter_list"}
    raw = dict(TINY, seq_length=seq, fused_gate_up=fused_gate_up)
    serial = LlamaForCausalLM(GalaxyConfig.from_dict(raw).model, seed=3).double()
    cfg = GalaxyConfig.from_dict(dict(raw, plan=plan, **splits))
    par = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double()
    # Built without tp_overlap (Gloo refuses torch's symm_mem ops); the layers then take the async-TP
    # edges over torch's reference ops at their TP blocks, as tp_overlap async_tp builds them on CUDA.
    plan = cfg.resolve_plan(ctx.mp.size)
    for layer in par.model.layers:
        layer.edges = LayerEdges(*(async_tp_edge(ctx.mp, plan, m, reference_ops()) if m.value == "TP"
                                   else PlainEdge(ctx.mp, plan, m) for m in (plan.att, plan.mlp)))
    layer = par.model.layers[0]
    assert isinstance(layer.edges.att, AsyncTpEdge)
    assert plain_operands([layer.self_attn.q_proj, layer.self_attn.o_proj]) is not None
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, TINY["vocab_size"], (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0  # right padding
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    _, worst = backward_both(serial, par, dict(input_ids=ids, attention_mask=mask, labels=labels), ctx,
                             par.model.stream)
    grads = {n: p.grad for n, p in serial.named_parameters()}
    for name, p in par.named_parameters():
        worst = max(worst, rel_err(gather_full(p.grad, p, ctx.mp), grads[name]))
    assert worst < MODEL_RTOL, worst
    return True


def refusal_case(ctx):
    with pytest.raises(ConfigError, match="tp_overlap.*CUDA GPUs over NCCL.*gloo"):
        AsyncTpEdges(ctx.mp)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 2])
def test_column_edge_equals_unfused(dist_pool, world, batch):
    assert all(dist_pool.run(column_case, world, batch))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 2])
def test_row_edge_equals_unfused(dist_pool, world, batch):
    assert all(dist_pool.run(row_case, world, batch))


@pytest.mark.parametrize("world, plan, fused_gate_up", [(2, "galaxy", False), (3, "galaxy", True),
                                                      (2, "galaxy2", True)])
def test_model_hook_equals_serial(dist_pool, world, plan, fused_gate_up):
    assert all(dist_pool.run(model_case, world, plan, fused_gate_up))


def test_gloo_group_refused(dist_pool):
    assert all(dist_pool.run(refusal_case, 2))


def test_single_process_runs_unfused():
    from galaxy.core.comm import Communicator
    from galaxy.models.llama import LlamaForCausalLM

    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(ConfigError, match="tp_overlap.*needs an NCCL process group"):
        AsyncTpEdges(Communicator("mp"))
    cfg = _cfg(plan="galaxy", tp_overlap="async_tp")  # one rank: nothing to overlap, edges stay unfused
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(1), seed=0)
    layer = model.model.layers[0]
    from galaxy.core.edges import PlainEdge
    assert type(layer.edges.att) is PlainEdge and type(layer.edges.mlp) is PlainEdge


def mp_of_one_case(ctx):
    """dp 2 x mp 1: the mp group of one must not fall back to the world group (it would gather over dp)."""
    from galaxy.core.overlap.async_tp import edges_for

    assert ctx.mp.size == 1 and edges_for(ctx.mp) is None
    return True


def test_mp_of_one_inside_dp_runs_unfused(dist_pool):
    assert all(dist_pool.run(mp_of_one_case, 2, dp=2))


# ----------------------------------------------------------------------------- the config key


def _cfg(**parallel):
    base = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
            "num_hidden_layers": 1, "max_position_embeddings": 64, "vocab_size": 64}
    return GalaxyConfig.from_dict({"model": base, "train": {"seq_length": 16}, "parallel": parallel})


def test_tp_overlap_resolves_chunks():
    assert _cfg(plan="galaxy", coc_parallel_num=2).resolve_plan(2).coc_parallel_num == 2  # legacy key alone
    assert _cfg(plan="galaxy").resolve_plan(2).coc_parallel_num is None  # COC_PARALLEL_NUM, else 1
    assert _cfg(plan="galaxy", tp_overlap="coc").resolve_plan(2).coc_parallel_num == 4
    assert _cfg(plan="galaxy", tp_overlap="coc", coc_parallel_num=8).resolve_plan(2).coc_parallel_num == 8
    none = _cfg(plan="galaxy", tp_overlap="none").resolve_plan(2)
    assert (none.coc_parallel_num, none.tp_overlap) == (1, "none")
    plan = _cfg(plan="galaxy2", tp_overlap="async_tp").resolve_plan(2)
    assert (plan.coc_parallel_num, plan.tp_overlap) == (1, "async_tp")


@pytest.mark.parametrize("parallel, message", [
    (dict(tp_overlap="symm"), "'tp_overlap': 'symm' is not one of none, coc, async_tp"),
    (dict(tp_overlap="async_tp", coc_parallel_num=4), "tp_overlap' is 'async_tp' but coc_parallel_num is 4"),
    (dict(tp_overlap="none", coc_parallel_num=2), "tp_overlap' is 'none' but coc_parallel_num is 2"),
    (dict(tp_overlap="coc", coc_parallel_num=1), "tp_overlap' is 'coc' but coc_parallel_num is 1"),
])
def test_tp_overlap_conflicts_refused(parallel, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _cfg(plan="galaxy", **parallel)


def test_async_tp_with_cclora_refused():
    with pytest.raises(ConfigError, match="async_tp does not combine with lora_fusion"):
        GalaxyConfig.from_dict({"model_type": "llama", "plan": "galaxy", "tp_overlap": "async_tp",
                                "tuning": "lora", "lora_fusion": True})


@pytest.mark.parametrize("plan", ["tp", "sp", "none"])
def test_async_tp_needs_sequence_edges(plan):
    with pytest.raises(ConfigError, match="async_tp fuses the all-gather/reduce-scatter.*use plan galaxy"):
        _cfg(plan=plan, tp_overlap="async_tp").resolve_plan(2)


def test_async_tp_uneven_split_refused():
    with pytest.raises(ConfigError, match=r"equal sequence shards.*\[7, 9\]"):
        _cfg(plan="galaxy", tp_overlap="async_tp", seq_scatter_list=[7, 9]).resolve_plan(2)
