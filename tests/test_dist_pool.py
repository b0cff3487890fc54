"""The test pool (tests/dist_pool.py) survives a task that kills a worker: that task fails at once, naming
the rank, and the next task runs on a fresh pool (before, every later test waited out the timeout)."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import DistPool


def rank_plus_world(ctx):
    ones = torch.ones(1)
    dist.all_reduce(ones, group=ctx.mp.process_group)
    return ctx.mp.rank + int(ones.item())


def rank_one_dies(ctx):
    if ctx.mp.rank == 1:
        os._exit(3)
    return ctx.mp.rank


def test_a_dead_worker_fails_its_task_and_the_pool_is_replaced():
    pool = DistPool(world=2)
    try:
        assert pool.run(rank_plus_world, 2) == [2, 3]
        # the dead worker's exit, not the task timeout, ends the wait: the error says which
        with pytest.raises(AssertionError, match=r"rank_one_dies: pool worker\(s\) \[1\] died \(exit codes \[3\]\)"):
            pool.run(rank_one_dies, 2)
        assert pool.run(rank_plus_world, 2) == [2, 3]
    finally:
        pool.close()
