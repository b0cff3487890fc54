"""On a Gloo group the Communicator's collectives never start a Gloo work named with more than 15 characters.

Each of a Gloo group's two worker threads, after finishing a work, assigns the work's name to one std::string
of the group outside any lock (torch 2.13, ``ProcessGroupGloo::runLoop``: ``pgStatus_->lastCompletedWorkName``).
A name of up to 15 characters stays in the string's inline buffer; a longer one puts it on the heap, where two
workers finishing together write into and free each other's buffer: the quickstart's rare heap corruption
(docs/design.md, "Gloo's work names"). The c10d operators that Gloo runs as such works are
``allgather_into_tensor_coalesced_`` and ``allgather_coalesced_`` (ALLGATHER_COALESCED, what a functional
all-gather dispatches) and ``allreduce_coalesced_`` (ALLREDUCE_COALESCED). The operators each collective
dispatches are read from the profiler, which records every c10d operator by name."""

import pytest
import torch
import torch._C._distributed_c10d as c10d
from torch.profiler import ProfilerActivity, profile

from galaxy.core.transitions import Layout, transition

# c10d operator -> the OpType of the work Gloo runs it as
LONG_NAMED = {"c10d::allgather_into_tensor_coalesced_": c10d.OpType.ALLGATHER_COALESCED,
              "c10d::allgather_coalesced_": c10d.OpType.ALLGATHER_COALESCED,
              "c10d::allreduce_coalesced_": c10d.OpType.ALLREDUCE_COALESCED}
INLINE_CHARS = 15  # libstdc++'s std::string keeps up to 15 characters without allocating


def dispatched_c10d_ops(ctx) -> dict[str, list[str]]:
    """Per Communicator collective (and a transition's forward and backward), the c10d operators it ran."""
    comm = ctx.mp
    n, rank = comm.size, comm.rank
    even, uneven = [2] * n, [1 + r for r in range(n)]
    x = torch.randn(3, 2 * n, 4)
    calls = {
        "all_reduce": lambda: comm.all_reduce(x),
        "all_gather": lambda: comm.all_gather(torch.randn(3, 2, 4), 1, even),
        "all_gather_uneven": lambda: comm.all_gather(torch.randn(3, uneven[rank], 4), 1, uneven),
        "reduce_scatter": lambda: comm.reduce_scatter(x, 1, even),
        "reduce_scatter_uneven": lambda: comm.reduce_scatter(torch.randn(3, sum(uneven), 4), 1, uneven),
        "all_to_all": lambda: comm.all_to_all([torch.randn(2)] * n, [(2,)] * n),
        "broadcast": lambda: comm.broadcast(x, 0),
        "sequence_to_tensor_parallel": lambda: transition(torch.randn(3, 2, 4, requires_grad=True), Layout.S,
                                                          Layout.T, comm, even).sum().backward(),
    }
    seen = {}
    for name, call in calls.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        seen[name] = sorted({e.name for e in prof.events() if e.name.startswith("c10d::")})
    return seen


def test_the_long_named_works_are_the_ones_named_here():
    assert all(len(op.name) > INLINE_CHARS for op in LONG_NAMED.values())
    assert len(c10d.OpType.ALLTOALL.name) <= INLINE_CHARS and len(c10d.OpType.ALLREDUCE.name) <= INLINE_CHARS


@pytest.mark.parametrize("world", [2, 3])
def test_no_collective_starts_a_gloo_work_with_a_heap_allocated_name(dist_pool, world):
    for seen in dist_pool.run(dispatched_c10d_ops, world):
        assert all(ops for ops in seen.values()), seen  # the profiler sees every collective's operators
        long_named = {name: sorted(set(ops) & set(LONG_NAMED)) for name, ops in seen.items()}
        assert not any(long_named.values()), long_named
