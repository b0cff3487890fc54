"""Shared by every test folder. Triton kernels run on CPU through the Triton interpreter, which reads
TRITON_INTERPRET when a kernel is defined (``@triton.jit``, at import): it is set here, before any test
module of any folder imports galaxy (tests/kernels and tests/loralib run the kernels)."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def dist_pool():
    from tests.dist_pool import DistPool

    pool = DistPool()
    yield pool
    pool.close()
