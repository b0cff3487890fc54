"""What the overlapped TP edges share (``galaxy.core.overlap.common``): the sequence-major layout and its
inverse, autocast's casts applied by hand, and the async collectives' padded layouts on two Gloo ranks
with uneven pieces (gathered rows in each rank's slot, a reduce-scatter into this rank's rows, bytes
counted as sent)."""

import torch

from galaxy.core.overlap.common import (apply_as_autocast, batch_major, cast_as_autocast, finish_into, seq_major,
                                        start_all_gather, start_all_reduce, start_reduce_scatter)

SIZES = (3, 2)  # rank 0 holds 3 rows, rank 1 two


def test_seq_major_and_back():
    x = torch.arange(2 * 3 * 4.0).view(2, 3, 4)
    s = seq_major(x)
    assert s.is_contiguous() and torch.equal(s[2, 1], x[1, 2]) and torch.equal(batch_major(s), x)
    one = torch.arange(12.0).view(1, 3, 4)
    assert seq_major(one).data_ptr() == one.data_ptr()  # b == 1: a view, no copy


class Recorded(torch.autograd.Function):
    """Returns ``x @ w`` and records in ``seen`` the dtypes it was given and whether autocast was on inside."""

    @staticmethod
    def forward(ctx, x, w, seen):
        seen.append((x.dtype, w.dtype, torch.is_autocast_enabled("cpu")))
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        return None, None, None


def test_operands_are_cast_as_autocast_would():
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    assert cast_as_autocast(x, torch.bfloat16).dtype == torch.bfloat16 and cast_as_autocast(x, None) is x
    for kept in (x.double(), torch.ones(2, dtype=torch.long), None):
        assert cast_as_autocast(kept, torch.bfloat16) is kept  # fp64, integers and None pass through
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = apply_as_autocast(Recorded, x, w, seen)
    y_plain = apply_as_autocast(Recorded, x, w, seen)
    assert seen == [(torch.bfloat16, torch.bfloat16, False), (torch.float32, torch.float32, False)]
    assert torch.equal(y, x.bfloat16() @ w.bfloat16()) and torch.equal(y_plain, x @ w)


def collectives_case(ctx):
    comm, r = ctx.mp, ctx.mp.rank
    rows = [torch.full((n, 2), 10.0 * q) + torch.arange(n)[:, None] for q, n in enumerate(SIZES)]
    before = comm.bytes_sent
    gathered = start_all_gather(comm, rows[r], SIZES, "fwd").wait()
    ok = gathered.shape == (2, 3, 2) and all(torch.equal(gathered[q, :n], rows[q]) for q, n in enumerate(SIZES))
    ok &= comm.bytes_sent - before == sum(SIZES) * 2 * 4  # rows of two fp32 values
    send = torch.arange(2 * 3 * 2.0).view(6, 2) * (r + 1)  # slot q (rows 3q..3q+2) goes to rank q
    dest = torch.empty(SIZES[r], 2)
    finish_into(dest, start_reduce_scatter(comm, send, SIZES, dest, "bwd"))
    summed = torch.arange(2 * 3 * 2.0).view(6, 2) * 3  # ranks 1 and 2 times the same rows
    ok &= torch.equal(dest, summed[3 * r: 3 * r + SIZES[r]])
    t = torch.full((4,), float(r + 1))
    ok &= start_all_reduce(comm, t, "fwd").wait() is t and torch.equal(t, torch.full((4,), 3.0))
    return bool(ok)


def test_async_collectives_on_uneven_pieces(dist_pool):
    assert dist_pool.run(collectives_case, 2) == [True, True]
