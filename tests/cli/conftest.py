"""The CLI tests' models are tiny: each test computes on one intra-op thread, in this process and in the CLI
processes it starts (OMP_NUM_THREADS, which they inherit). A second OpenMP thread gains nothing on shapes this
small, and on a loaded host it spins waiting for work on a core that another process needs: on two shared cores
test_finetune.py's 150 steps took 139 s of CPU on two threads against 14 s on one (2026-12-02). A local launch of
several ranks sets each rank's threads itself (``galaxy.cli.launch.rank_context``): one apiece on two cores."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
