"""Where the local ranks of a ``--world N`` launch come from: forked from a forkserver that has torch and
Galaxy's training code imported, not spawned as new interpreters.

A spawned rank is a new Python that imports torch and Galaxy again, about 4 s of CPU a rank on the 2-core test
host (2026-12-03: a 2-rank, 2-step tiny-BERT launch took 11.4 s of CPU spawned, 9.3 s forked), most of what a
small run costs. Multiprocessing's forkserver imports them once (``rank_forkserver``, its one preload), in a
process of its own that this launcher starts, and forks each rank from it; a process that launches several
runs (a Python session, the test suite) keeps the one forkserver for all of them, and a rank then starts in
milliseconds. The forkserver is a single-threaded process that has only imported (no device touched, no
OpenMP pool started), which is what makes forking it safe; it ends when its launcher does.

A forked rank is the forkserver's child, not the launcher's, so it takes from the launcher what it would
otherwise inherit from the forkserver (``Handover``): the environment as it is now and the launcher's stdout
and stderr as they are now (a launcher may have redirected them since the forkserver started). The few environment
variables read while the forkserver started and imported torch (``READ_AT_IMPORT``: the loader's, OpenMP's, torch's
logging) keep the forkserver's values; where the launcher's differ the rank says so (``Handover.take``): they take
effect in a new process.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from multiprocessing import reduction

# What the forkserver imports (one module: it imports the rest and holds the stop signals, see there).
PRELOAD = ["galaxy.cli.rank_forkserver"]
# Variables read while the forkserver started and imported torch (the dynamic loader, the OpenMP and MKL runtimes,
# torch's logging), fixed there from then on; the rest (CUDA_*, NCCL, TORCH_NCCL_*, TORCHINDUCTOR_*, Triton, Galaxy's
# own) are read later, in the rank, after ``Handover.take``. OMP_NUM_THREADS is not among them: each local rank sets
# its thread count from it itself (``galaxy.cli.launch.local_rank_threads``).
READ_AT_IMPORT = ("LD_", "OMP_", "KMP_", "MKL_", "TORCH_LOGS", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_CPP_LOG_LEVEL")
SET_BY_EACH_RANK = ("OMP_NUM_THREADS",)


def rank_process_context():
    """The multiprocessing context a local launch starts its ranks with: the forkserver where the platform has
    one (started now if it is not running), else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # used when the forkserver starts: the first launch of this process
    multiprocessing.forkserver.ensure_running()
    return context


def leave_forkserver() -> None:
    """In a rank forked from the forkserver: close this process's copy of the launcher's end of the pipe whose
    closing tells the forkserver its launcher is gone (multiprocessing hands every child one, for children of
    its own). Otherwise a launcher killed with ``kill -9`` would leave the forkserver waiting on its ranks and
    the ranks, whose parent-death signal follows the forkserver, running. No effect in a spawned rank."""
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


class Handover:
    """What a rank takes from its launcher when it starts: the launcher's environment and its stdout and
    stderr (file descriptors, passed to the rank as such by multiprocessing)."""

    def __init__(self, environ: dict[str, str], stdout: int, stderr: int):
        self.environ, self.stdout, self.stderr = environ, stdout, stderr

    @classmethod
    def from_launcher(cls) -> "Handover":
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        return cls(dict(os.environ), 1, 2)

    def __reduce__(self):
        # Pickled while multiprocessing starts the rank: DupFd hands the descriptors to that process.
        return Handover._arrived, (self.environ, reduction.DupFd(self.stdout), reduction.DupFd(self.stderr))

    @classmethod
    def _arrived(cls, environ: dict[str, str], stdout, stderr) -> "Handover":
        return cls(environ, stdout.detach(), stderr.detach())

    def take(self) -> list[str]:
        """Make this process's environment, stdout and stderr the launcher's; returns the variables read at
        import whose values differ from the launcher's (the forkserver's stay in force)."""
        stale = sorted(k for k in set(os.environ) | set(self.environ) if k.startswith(READ_AT_IMPORT)
                       and k not in SET_BY_EACH_RANK and os.environ.get(k) != self.environ.get(k))
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, target in ((self.stdout, 1), (self.stderr, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        return stale
