"""Local ranks forked from the forkserver (``galaxy.cli.rank_processes``): each launch's ranks get that launch's
environment and output streams, the forkserver is kept between launches, holds the stop signals and ends with
its launcher; a stop signal sent to the whole process group ends the run as Ctrl-C does."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from galaxy.cli.launch import Launch, launch_local, launch_ranks
from galaxy.config import GalaxyConfig
from tests import REPO

MARK = "GALAXY_TEST_RANK_MARK"


def tell(rank: int, launch: Launch, payload) -> None:
    """A rank that prints what it got from its launcher, and its parent with that parent's blocked signals."""
    parent = os.getppid()
    with open(f"/proc/{parent}/status") as f:
        blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    stops = [signum for signum in (signal.SIGINT, signal.SIGTERM) if blocked & (1 << (signum - 1))]
    print(f"rank {rank} mark={os.environ.get(MARK)} parent={parent} parent_blocks={len(stops)}")
    print(f"rank {rank} on stderr", file=sys.stderr)


def told(out: str) -> dict[int, dict[str, str]]:
    found = {}
    for line in out.splitlines():
        if line.startswith("rank ") and " mark=" in line:
            words = line.split()
            found[int(words[1])] = dict(w.split("=", 1) for w in words[2:])
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_each_launch_hands_its_ranks_its_own_environment_and_streams(capfd, monkeypatch):
    """Two launches from one process: one forkserver (the ranks' parent, not this process) serves both, and each
    launch's ranks see the environment and write to the stdout and stderr of this process as they are at that
    launch (capfd redirects them per test; the forkserver may have started in an earlier test)."""
    seen = []
    for mark in ("first", "second"):
        monkeypatch.setenv(MARK, mark)
        assert launch_ranks(tell, Launch(2, None, None, None), None, GalaxyConfig()) == 0
        out, err = capfd.readouterr()
        ranks = told(out)
        assert sorted(ranks) == [0, 1], out
        assert {r["mark"] for r in ranks.values()} == {mark}, out
        assert all(f"rank {rank} on stderr" in err for rank in (0, 1)), err
        seen.append({r["parent"] for r in ranks.values()})
        assert {r["parent_blocks"] for r in ranks.values()} == {"2"}, "the forkserver holds SIGINT and SIGTERM"
    assert seen[0] == seen[1] and len(seen[0]) == 1, f"one forkserver for both launches: {seen}"
    assert seen[0] != {str(os.getpid())}, "the ranks were forked from the forkserver, not started by this process"


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="ranks are spawned here")
def test_a_variable_torch_reads_at_import_changed_since_the_forkserver_started_is_named(capfd, monkeypatch):
    """The forkserver imported torch with the environment of the first launch: a launch that changes a variable
    read at import gets one warning naming it (it takes effect in a new process), not silence; one read later,
    in the rank, is in force and not named."""
    assert launch_ranks(tell, Launch(2, None, None, None), None, GalaxyConfig()) == 0  # the forkserver runs
    capfd.readouterr()
    name = f"KMP_GALAXY_TEST_{uuid.uuid4().hex[:8].upper()}"  # OpenMP's prefix: read as the runtime loads
    later = f"TORCH_NCCL_GALAXY_TEST_{uuid.uuid4().hex[:8].upper()}"  # read when a process group starts: in force
    monkeypatch.setenv(name, "1")
    monkeypatch.setenv(later, "1")
    assert launch_ranks(tell, Launch(2, None, None, None), None, GalaxyConfig()) == 0
    err = capfd.readouterr().err
    assert err.count(f"{name} changed since this process's first local launch") == 1, err
    assert later not in err, err


def tell_threads(rank: int, launch: Launch, payload) -> None:
    import torch

    print(f"rank {rank} mark=- parent=- parent_blocks=- threads={torch.get_num_threads()}")


def test_a_local_rank_takes_its_thread_count_from_its_launcher(capfd, monkeypatch):
    """The forkserver's OpenMP read OMP_NUM_THREADS once, when it loaded (this suite's: 1): a rank forked from
    it uses its launcher's value of this launch (compare's one-rank launch too), or without one the cores
    shared among the ranks."""
    for world, threads, expected in ((1, "3", 3), (2, "2", 2), (2, None, max(1, (os.cpu_count() or 1) // 2))):
        if threads is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", threads)
        assert launch_local(tell_threads, Launch(world, None, None, None), None, GalaxyConfig()) == 0
        ranks = told(capfd.readouterr().out)
        assert sorted(ranks) == list(range(world)) and {r["threads"] for r in ranks.values()} == {str(expected)}, \
            (world, threads, ranks)


TINY = ["--no_progress", "--override", "global_batch_size=4", "--override", "seq_length=16", "--override",
        "hidden_size=32", "--override", "num_attention_heads=2", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups as a Linux terminal has them")
def test_sigterm_to_the_whole_process_group_stops_the_run_with_a_checkpoint(tmp_path):
    """``timeout`` and schedulers send SIGTERM to every process of the job: the forkserver (the ranks' parent)
    must not die of it, which would kill the ranks before they save; the run stops as after Ctrl-C."""
    save_dir, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    run = subprocess.Popen([sys.executable, "pretrain_galaxy.py", "--world", "2", "--max_steps", "100000",
                            "--save_dir", str(save_dir), "--save_every", "100000", "--metrics_file", str(metrics),
                            "--override", "log_every=1", *TINY], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # for a loaded host to reach a step, not a verdict
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never got to its second step"
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGTERM)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    assert run.returncode == 130, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted at step ") and "saved; resume with --resume" in last, err[-3000:]
    assert [d.name for d in save_dir.iterdir() if d.name.startswith("step_")], "no checkpoint was saved"
