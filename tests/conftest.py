"""Shared by every test folder. Without a GPU, Triton kernels run on CPU through the Triton interpreter, which
reads TRITON_INTERPRET when a kernel is defined (``@triton.jit``, at import): it is set here, before any test
module of any folder imports galaxy (tests/kernels and tests/loralib run the kernels); ``triton_cpu``
skips, with the reason, where they cannot (on a GPU machine, whose tests run the kernels compiled: under the
interpreter every GPU test's kernel failed)."""

import functools
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every compiled test, in this process, the pool's and the CLIs' it starts, builds scalar C++ kernels: g++ takes
# about 40% less time on them (the graph is the same; on a GPU inductor writes Triton either way), and one process
# that builds both kinds fails (torch 2.13: a vectorized kernel compiled after a scalar one lacks its ISA's macros,
# 'at::vec has not been declared'; seen in the suite when test_offload.py ran before test_recompute.py). Set
# through the environment, which torch._inductor.config reads when imported, so that a process that compiles
# nothing does not import inductor (about 2 s of CPU) only to set it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Every compiling process builds its kernels itself, one after another: with two compile threads (the default on
# this 2-core host) each one first starts a pool of compile workers, an interpreter importing torch (about 2.5 s of
# CPU a process), for a test's ~20 kernels, while the other pytest workers already keep both cores busy (2026-12-04,
# the ten compiling test files alone, empty inductor cache: 715 s of CPU, 700 with one thread; the same g++ calls).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One intra-op thread in every test (``one_intra_op_thread``) and in every process a test starts (they inherit
# OMP_NUM_THREADS; a local launch of several ranks still sets each rank's own, galaxy.cli.launch.rank_context). The
# tests' shapes are tiny: a second OpenMP thread gains nothing on them, and beside the other pytest workers and the
# ranks it spins waiting for work on a core another process needs (2026-12-02, one file alone on the busy 2-core
# host: test_precision.py 96.8 s of CPU on two threads against 32.5 on one, test_equivalence.py 79.7 against 64.5;
# test_finetune.py 139 against 14).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    """Byte-compile galaxy and the tests once, in the process that starts the session (pytest-xdist's controller,
    or the one process of ``-n 0``), before any worker runs. Under PYTHONDONTWRITEBYTECODE (set on this project's
    hosts) no process writes a .pyc, so each of the hundreds the suite starts (CLI launchers, their ranks, the pool)
    compiled every galaxy module it imports from source again: about 0.4 s of CPU per process. compileall writes the
    __pycache__ files (git ignores them) whatever that flag says; a stale one is never used (the import checks the
    source's mtime and size)."""
    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("galaxy", "tests"):
        compileall.compile_dir(os.path.join(root, package), quiet=1)


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Each test on one thread, whatever a test before it in this worker set (an in-process bench main sets its
    own)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dist_pool():
    from tests.dist_pool import DistPool

    pool = DistPool()
    yield pool
    pool.close()


@functools.lru_cache(maxsize=1)
def _interpreter_problem() -> str | None:
    """Why Triton-path tests cannot run here, or None when they can."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return "triton is not installed (`pip install triton`): Triton-path tests skipped"
    from galaxy.kernels import triton_interpret_enabled

    if not triton_interpret_enabled():
        return "TRITON_INTERPRET is not 1, so Triton kernels cannot run on CPU tensors"

    # A loop with a runtime bound: triton<=3.6's interpreter breaks on it under numpy>=2.4
    # (triton-lang/triton#9171), which every kernel with a vocab/row loop relies on.
    @triton.jit
    def _probe(X, n, BLOCK: tl.constexpr):
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(X + offs, offs.to(tl.float32), mask=offs < n)

    x = torch.zeros(10)
    try:
        _probe[(1,)](x, 10, BLOCK=4)
    except Exception as err:  # noqa: BLE001 - any failure means the interpreter is unusable
        import numpy

        return (
            f"the Triton {triton.__version__} interpreter fails with numpy {numpy.__version__} "
            f"({err!r}); use triton>=3.7 or numpy<2.4 for CPU kernel tests"
        )
    if not torch.equal(x, torch.arange(10, dtype=torch.float32)):
        return "the Triton interpreter probe kernel computed a wrong result"
    return None


@pytest.fixture
def triton_cpu():
    """Skip (with the reason) unless Triton kernels can run on CPU tensors here."""
    problem = _interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
