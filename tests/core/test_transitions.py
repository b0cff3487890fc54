"""Every transition preserves the value of the activation and its backward is the adjoint of its
forward: <f(x), y> == <x, f*(y)> under the layout pairings, with uneven splits at world 2-4."""

import pytest
import torch
import torch.distributed as dist

from galaxy.core.transitions import Layout, transition

SPLITS = {2: (3, 5), 3: (1, 4, 2), 4: (2, 3, 1, 4)}
CELLS = [(s, d) for s in (Layout.P, Layout.R, Layout.S) for d in (Layout.T, Layout.R, Layout.S)]


def _sum(comm, t):
    t = t.clone()
    dist.all_reduce(t, group=comm.group)
    return t


def _full(comm, shared_gen, shape):
    """A tensor drawn identically on every rank."""
    return torch.randn(shape, generator=shared_gen, dtype=torch.float64)


def _value(comm, t, layout, sizes):
    """The logical (full) value a distributed tensor represents."""
    if layout == Layout.P:
        return _sum(comm, t)
    if layout == Layout.S:
        return comm.all_gather(t, 1, sizes)
    return t


def adjoint_case(ctx, src, dst):
    comm, n = ctx.mp, ctx.mp.size
    sizes = SPLITS[n]
    shared = torch.Generator().manual_seed(11)
    own = torch.Generator().manual_seed(100 + comm.rank)
    full_shape = (2, sum(sizes), 3)
    local_shape = (2, sizes[comm.rank], 3)
    # a valid input in the source layout
    if src == Layout.R:
        x = _full(comm, shared, full_shape)
    elif src == Layout.P:
        x = torch.randn(full_shape, generator=own, dtype=torch.float64)
    else:
        x = torch.randn(local_shape, generator=own, dtype=torch.float64)
    # a valid gradient in the destination layout: T's is partial, R's replicated, S's a slice
    if dst == Layout.T:
        y = torch.randn(full_shape, generator=own, dtype=torch.float64)
    elif dst == Layout.R:
        y = _full(comm, shared, full_shape)
    else:
        y = torch.randn(local_shape, generator=own, dtype=torch.float64)
    x.requires_grad_(True)
    out = transition(x, src, dst, comm, sizes)
    (out * y).sum().backward()

    # forward keeps the value
    dst_value = Layout.R if dst == Layout.T else dst
    torch.testing.assert_close(_value(comm, out.detach(), dst_value, sizes),
                               _value(comm, x.detach(), src, sizes), rtol=1e-12, atol=1e-12)

    # pairing: sum over ranks of local dot products, counted once for replicated-replicated pairs
    def pairing(a, b, layout):
        local = (a * b).sum().reshape(1)
        return _sum(comm, local) / (n if layout == Layout.R else 1)

    lhs = pairing(out.detach(), y, dst)
    rhs = pairing(x.detach(), x.grad, src)
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)
    return lhs.item()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("src,dst", CELLS, ids=[f"{s.value}to{d.value}" for s, d in CELLS])
def test_transition_adjoint(dist_pool, world, src, dst):
    results = dist_pool.run(adjoint_case, world, src, dst)
    assert len(set(round(r, 9) for r in results)) == 1
