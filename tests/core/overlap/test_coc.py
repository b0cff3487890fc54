"""CoC (galaxy.core.overlap.coc) equals the unfused path it replaces: ``transition`` + ``F.linear``.

For every fused function, chunk counts 1/2/4/8 at world 2, 3 and 4 with uneven sequence splits
and uneven weight shards (float64, batch 1 and 2): the outputs and every gradient (input,
weights, biases) match the reference to 1e-9 relative, including chunk counts larger than a
rank's tokens. Also: byte accounting equals the unfused path's, observers see every chunk,
autocast behaves like F.linear's, and the config surface validates.
"""

import pytest
import torch
import torch.nn.functional as F

from galaxy.core.transitions import Layout, transition
from galaxy.core.overlap.coc import (ChunkSchedule, all_gather_linear, coc_chunks, copy_linear, linear_all_reduce,
                                linear_reduce_scatter)

SPLITS = {2: (3, 5), 3: (1, 4, 2), 4: (2, 3, 1, 4)}  # tokens per rank; 8 chunks exceed every one
CHUNKS = (1, 2, 4, 8)
RTOL = 1e-9
H, OUT = 6, 5  # hidden width; output width of a row-parallel linear


# ----------------------------------------------------------------------------- helpers (run on the ranks)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _leaves(tensors, requires=None):
    requires = requires or [True] * len(tensors)
    return [None if t is None else t.detach().clone().requires_grad_(need) for t, need in zip(tensors, requires)]


def _grads(outputs, grad_outputs, leaves):
    torch.autograd.backward(list(outputs), list(grad_outputs))
    return [None if t is None or not t.requires_grad else t.grad for t in leaves]


def _assert_close(got, want, what):
    if want is None or got is None:
        assert got is None and want is None, f"{what}: got {got is not None}, want {want is not None}"
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= RTOL * max(scale, 1e-300), f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def _compare(ctx, fused, reference, inputs, grad_outputs, label, requires=None):
    """Run both on fresh copies of ``inputs``; compare outputs and the gradients of every input."""
    outs, fired = {}, {}
    for name, fn in (("fused", fused), ("reference", reference)):
        leaves = _leaves(inputs, requires)
        # Which leaves' post-accumulate-grad hooks fire (data-parallel bucketing counts them):
        # it must be the same set as in the unfused graph, also for leaves that get no gradient.
        fired[name] = []
        for i, t in enumerate(leaves):
            if t is not None and t.requires_grad:
                t.register_post_accumulate_grad_hook(lambda p, i=i, seen=fired[name]: seen.append(i))
        y = fn(*leaves)
        ys = list(y) if isinstance(y, (list, tuple)) else [y]
        outs[name] = ([t.detach() for t in ys], _grads(ys, grad_outputs, leaves))
    assert sorted(fired["fused"]) == sorted(fired["reference"]), (label, fired)
    (y1, g1), (y0, g0) = outs["fused"], outs["reference"]
    for i, (a, b) in enumerate(zip(y1, y0)):
        _assert_close(a, b, f"rank {ctx.mp.rank} {label}: output {i}")
    for i, (a, b) in enumerate(zip(g1, g0)):
        _assert_close(a, b, f"rank {ctx.mp.rank} {label}: grad of input {i}")


# ----------------------------------------------------------------------------- cases (module level, for the pool)


def all_gather_linear_case(ctx, batch, split=None, chunk_counts=CHUNKS):
    comm, r = ctx.mp, ctx.mp.rank
    split = split or SPLITS[comm.size]
    own = _gen(100 + r)
    total = sum(split)
    widths = (2 + r % 3, 1 + r, 3)  # uneven column shards, e.g. q/k/v
    x = _randn((batch, split[r], H), own)
    weights = [_randn((w, H), own) for w in widths]
    biases = [_randn((widths[0],), own), None, _randn((widths[2],), own)]
    grad_outputs = [_randn((batch, total, w), own) for w in widths]

    def reference(x, *params):
        full = transition(x, Layout.S, Layout.T, comm, split)
        return [F.linear(full, w, b) for w, b in zip(params[:3], params[3:])]

    for chunks in chunk_counts:
        def fused(x, *params, chunks=chunks):
            return all_gather_linear(x, params[:3], params[3:], comm, split, chunks)

        _compare(ctx, fused, reference, [x, *weights, *biases], grad_outputs, f"chunks={chunks} b={batch}")
    return True


def copy_linear_case(ctx, batch, chunk_counts=CHUNKS):
    comm, r = ctx.mp, ctx.mp.rank
    shared, own = _gen(7), _gen(100 + r)
    seq = sum(SPLITS[comm.size])
    widths = (1 + r, 2 + r % 2)
    x = _randn((batch, seq, H), shared)  # replicated
    weights = [_randn((w, H), own) for w in widths]
    biases = [None, _randn((widths[1],), own)]
    grad_outputs = [_randn((batch, seq, w), own) for w in widths]

    def reference(x, *params):
        full = transition(x, Layout.R, Layout.T, comm, ())
        return [F.linear(full, w, b) for w, b in zip(params[:2], params[2:])]

    for chunks in chunk_counts:
        def fused(x, *params, chunks=chunks):
            return copy_linear(x, params[:2], params[2:], comm, chunks)

        _compare(ctx, fused, reference, [x, *weights, *biases], grad_outputs, f"chunks={chunks} b={batch}")
    return True


def linear_reduce_scatter_case(ctx, batch, x_grad=True, split=None, chunk_counts=CHUNKS):
    comm, r = ctx.mp, ctx.mp.rank
    split = split or SPLITS[comm.size]
    shared, own = _gen(7), _gen(100 + r)
    total, in_local = sum(split), 2 + r  # uneven row shards
    x = _randn((batch, total, in_local), own)
    weight = _randn((OUT, in_local), own)
    bias = _randn((OUT,), shared)  # a replicated value (PARTIAL gradient rule)
    grad_output = _randn((batch, split[r], OUT), own)

    def reference(x, w, b):
        return transition(F.linear(x, w, b if r == 0 else None), Layout.P, Layout.S, comm, split)

    for chunks in chunk_counts:
        def fused(x, w, b, chunks=chunks):
            return linear_reduce_scatter(x, w, b, comm, split, chunks)

        _compare(ctx, fused, reference, [x, weight, bias], [grad_output], f"chunks={chunks} b={batch} x_grad={x_grad}",
                 requires=[x_grad, True, True])
    return True


def linear_all_reduce_case(ctx, batch, dst, seq=None, chunk_counts=CHUNKS):
    comm, r = ctx.mp, ctx.mp.rank
    shared, own = _gen(7), _gen(100 + r)
    seq = seq or sum(SPLITS[comm.size])
    in_local = 1 + 2 * r
    x = _randn((batch, seq, in_local), own)
    weight = _randn((OUT, in_local), own)
    bias = _randn((OUT,), shared)
    # P -> R's output gradient is replicated; P -> T's is partial (different on every rank).
    grad_output = _randn((batch, seq, OUT), shared if dst == "R" else own)

    def reference(x, w, b):
        return transition(F.linear(x, w, b if r == 0 else None), Layout.P, Layout(dst), comm, ())

    for chunks in chunk_counts:
        def fused(x, w, b, chunks=chunks):
            return linear_all_reduce(x, w, b, comm, chunks, dst=dst)

        _compare(ctx, fused, reference, [x, weight, bias], [grad_output], f"chunks={chunks} b={batch} dst={dst}")
    return True


def accounting_case(ctx, chunks):
    """Bytes per (op, phase) of each fused function equal the unfused path's; observers see every chunk."""
    comm, r = ctx.mp, ctx.mp.rank
    split = SPLITS[comm.size]
    own = _gen(5 + r)
    total = sum(split)

    def layer(k):
        x = _randn((1, split[r], H), own).requires_grad_(True)
        w1, w2 = _randn((3, H), own).requires_grad_(True), _randn((OUT, 3), own).requires_grad_(True)
        (a,) = all_gather_linear(x, [w1], [None], comm, split, k)
        y = linear_reduce_scatter(a, w2, None, comm, split, k)
        z = linear_all_reduce(_randn((1, total, 3), own), w2, None, comm, k, dst="T")
        (y.sum() + z.sum()).backward()

    seen = {}

    def observe(rec):
        key = (rec.op, rec.phase)
        calls, nbytes = seen.get(key, (0, 0))
        seen[key] = (calls + 1, nbytes + rec.nbytes)

    comm.observers.append(observe)
    try:
        layer(1)
        plain, seen = seen, {}
        layer(chunks)
        fused = seen
    finally:
        comm.observers.remove(observe)
    before = comm.bytes_sent
    layer(chunks)
    unobserved = comm.bytes_sent - before
    assert {k: v[1] for k, v in fused.items()} == {k: v[1] for k, v in plain.items()}, (fused, plain)
    assert unobserved == sum(v[1] for v in plain.values())
    sched = ChunkSchedule.build(split, chunks)
    assert fused[("all_gather", "fwd")][0] == sched.count and fused[("reduce_scatter", "fwd")][0] == sched.count
    return True


def flops_case(ctx, chunks):
    """Dispatch-level FLOPs (torch's FlopCounterMode) of fwd+bwd equal the unfused path's: no
    padded rows are multiplied and every matmul is an op the counters price."""
    from torch.utils.flop_counter import FlopCounterMode

    comm, r = ctx.mp, ctx.mp.rank
    split = SPLITS[comm.size]
    own = _gen(3 + r)
    total = sum(split)
    x = _randn((2, split[r], H), own)
    w_col = [_randn((2 + r, H), own), _randn((3, H), own)]
    w_row = _randn((OUT, 2 + r), own)
    x_rep = _randn((2, total, H), _gen(1))

    def layer(k):
        leaves = _leaves([x, *w_col, w_row, x_rep])
        a, b = all_gather_linear(leaves[0], leaves[1:3], None, comm, split, k)
        y = linear_reduce_scatter(a * 1.0, leaves[3], None, comm, split, k)
        c, _ = copy_linear(leaves[4], leaves[1:3], None, comm, k)
        z = linear_all_reduce(c, leaves[3], None, comm, k, dst="T")
        (y.sum() + z.sum() + b.sum()).backward()

    counts = []
    for k in (1, chunks):
        with FlopCounterMode(display=False) as counter:
            layer(k)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0, counts
    return counts[1]


def autocast_case(ctx, chunks):
    """Under CPU bf16 autocast (fp32 parameters), CoC casts like F.linear and matches CoC 1."""
    comm, r = ctx.mp, ctx.mp.rank
    split = SPLITS[comm.size]
    own = _gen(9 + r)
    x = torch.randn(1, split[r], 16, generator=own)
    w1, w2 = torch.randn(8, 16, generator=own), torch.randn(16, 8, generator=own)
    results = []
    for k in (1, chunks):
        leaves = _leaves([x, w1, w2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (a,) = all_gather_linear(leaves[0], [leaves[1]], [None], comm, split, k)
            y = linear_reduce_scatter(a, leaves[2], None, comm, split, k)
        assert a.dtype == y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        assert all(t.grad.dtype == torch.float32 for t in leaves)
        results.append([y.detach().float()] + [t.grad for t in leaves])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    return True


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_all_gather_linear(dist_pool, world, batch):
    assert all(dist_pool.run(all_gather_linear_case, world, batch))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_linear_reduce_scatter(dist_pool, world, batch):
    assert all(dist_pool.run(linear_reduce_scatter_case, world, batch))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dst", ["R", "T"])
def test_linear_all_reduce(dist_pool, world, dst):
    assert all(dist_pool.run(linear_all_reduce_case, world, 2, dst))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_copy_linear(dist_pool, world):
    assert all(dist_pool.run(copy_linear_case, world, 2))


@pytest.mark.parametrize("world", [2, 4])
def test_more_chunks_than_tokens(dist_pool, world):
    """One token on some ranks and 8 chunks: empty pieces, still exact (also with x not needing grad)."""
    split = (1,) * (world - 1) + (2,)
    assert all(dist_pool.run(all_gather_linear_case, world, 1, split, (8,)))
    assert all(dist_pool.run(linear_reduce_scatter_case, world, 1, False, split, (4, 8)))
    assert all(dist_pool.run(linear_all_reduce_case, world, 1, "T", 3, (8,)))


@pytest.mark.parametrize("world,chunks", [(2, 4), (3, 8)])
def test_comm_accounting(dist_pool, world, chunks):
    assert all(dist_pool.run(accounting_case, world, chunks))


def test_flops_match_unfused(dist_pool):
    assert all(dist_pool.run(flops_case, 3, 4))


def test_autocast(dist_pool):
    assert all(dist_pool.run(autocast_case, 2, 4))


def test_chunk_schedule():
    s = ChunkSchedule.build((3, 5), 4)
    assert s.pieces == ((1, 2), (1, 1), (1, 1), (0, 1))
    assert [s.rows(c, 1) for c in range(4)] == [slice(3, 5), slice(5, 6), slice(6, 7), slice(7, 8)]
    assert ChunkSchedule.build((1, 2), 8).count == 2  # no chunk empty on every rank
    assert ChunkSchedule.build((4, 4), 1).pieces == ((4, 4),)


def test_coc_chunks():
    assert coc_chunks(None, {}) == 1
    assert coc_chunks(None, {"COC_PARALLEL_NUM": "4"}) == 4
    assert coc_chunks(2, {"COC_PARALLEL_NUM": "8"}) == 2  # the config wins
    for bad in (3, 0, 16, True, 2.0):
        with pytest.raises(ValueError, match="coc_parallel_num"):
            coc_chunks(bad, {})
    for bad in ("3", "two", "-2"):
        with pytest.raises(ValueError, match="COC_PARALLEL_NUM"):
            coc_chunks(None, {"COC_PARALLEL_NUM": bad})


