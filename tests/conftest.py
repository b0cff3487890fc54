"""Shared by every test folder. Triton kernels run on CPU through the Triton interpreter, which reads
TRITON_INTERPRET when a kernel is defined (``@triton.jit``, at import): it is set here, before any test
module of any folder imports galaxy (tests/kernels and tests/loralib run the kernels).

The files that take minutes are collected first: pytest-xdist (``--dist loadfile``, pytest.ini) hands out
files in collection order, and test_peft.py, collected in the middle by name, used to end the run alone
on one worker while the other sat idle."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Slowest first (summed test times per file, 2026-11-27); every other file keeps its place after them.
SLOW_FILES = ("peft/test_peft.py", "cli/test_cli.py", "cli/test_finetune.py", "planner/test_planner.py",
              "train/test_precision.py", "bench/test_bench_edge.py")


def pytest_collection_modifyitems(session, config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    first = {os.path.join(here, name): i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(str(item.path), len(first)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def dist_pool():
    from tests.dist_pool import DistPool

    pool = DistPool()
    yield pool
    pool.close()
