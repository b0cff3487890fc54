"""The local launcher's children (``--world N`` without ``--rank``) end with ``os._exit``: what a rank
printed or logged still arrives, and the exit code still tells the launcher how the rank ended."""

from __future__ import annotations

import logging

from galaxy.cli.launch import Launch, launch_ranks
from galaxy.config import GalaxyConfig
from tests import REPO


def speak(rank: int, launch: Launch, payload) -> None:
    """A launcher child: prints without flushing (stdout is a file here, so block-buffered) and logs."""
    print(f"rank {rank} of {launch.world} says {payload}")
    logging.getLogger("galaxy.test_launch").warning("rank %d logs", rank)
    if payload == "fail" and rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_children_output_arrives_and_the_launch_succeeds(capfd, monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the children's stdout is block-buffered
    assert launch_ranks(speak, Launch(2, None, None, None), "hello", GalaxyConfig()) == 0
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"rank {rank} of 2 says hello" in out, out
        assert f"rank {rank} logs" in err, err


def test_a_failed_child_is_reported_with_its_exit_code(capfd):
    assert launch_ranks(speak, Launch(2, None, None, None), "fail", GalaxyConfig()) == 1
    err = capfd.readouterr().err
    assert "error (rank 1): rank 1 fails on purpose" in err, err
    assert "error: rank 1 exited with code 1;" in err, err


def test_a_step_without_zero_leaves_torch_distributed_optim_unimported():
    # Importing torch.distributed.optim after init_process_group binds the live WORLD group as a default
    # argument, keeping the Gloo group (and the worker thread that aborted at exit) past destroy.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, types, torch
        from galaxy.train.loop import Trainer
        owner = types.SimpleNamespace(optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
        Trainer.count_zero_broadcasts(owner)
        print("torch.distributed.optim" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


RANKS_WITH_A_LOCK = """
import multiprocessing
import sys

from galaxy.cli.launch import Launch, launch_ranks
from galaxy.config import GalaxyConfig


def hold_a_lock(rank, launch, payload):
    global lock
    lock = multiprocessing.RLock()  # a named semaphore, as tqdm's progress bar makes in rank 0


if __name__ == "__main__":
    sys.exit(launch_ranks(hold_a_lock, Launch(2, None, None, None), None, GalaxyConfig()))
"""


def test_children_leave_no_semaphore_behind(tmp_path):
    # os._exit skips multiprocessing's own cleanup unless the child runs it first: the resource tracker
    # then warns of leaked semaphores when the launcher exits.
    import os
    import subprocess
    import sys

    script = tmp_path / "ranks_with_a_lock.py"
    script.write_text(RANKS_WITH_A_LOCK)
    root = REPO
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "leaked semaphore" not in out.stderr, out.stderr
