"""One run per save directory (``galaxy.train.checkpoint.lock``): the lock names its holder, a second
holder is refused while the first lives, a dead holder's lock is taken over with one warning, the
launcher's lock covers the processes it starts, and releasing removes the file."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from galaxy.train.checkpoint.lock import LOCK_FILE, SaveDirInUse, SaveDirLock
from tests import REPO

ENV = dict(os.environ, PYTHONPATH=REPO)

# Takes the lock, says so, then (with "child") starts a process that tries it too and prints what it got.
HOLDER = """
import subprocess, sys, time
from galaxy.train.checkpoint.lock import SaveDirLock
lock = SaveDirLock.acquire(sys.argv[1])
print("held", flush=True)
if sys.argv[2] == "child":
    print(subprocess.run([sys.executable, "-c", "import sys; from galaxy.train.checkpoint.lock import SaveDirLock; "
                          "print(SaveDirLock.acquire(sys.argv[1]))", sys.argv[1]], capture_output=True,
                         text=True).stdout.strip(), flush=True)
time.sleep(600)
"""


def hold(directory, then: str = "wait") -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), then], env=ENV, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_lock_names_its_holder_and_is_removed_on_release(tmp_path):
    lock = SaveDirLock.acquire(str(tmp_path))
    owner = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (owner["host"], owner["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(SaveDirInUse, match=f"is in use by another run \\(host {socket.gethostname()}, pid "
                                           f"{os.getpid()}, started "):
        SaveDirLock.acquire(str(tmp_path))  # another open of the file: refused, as another process would be
    lock.release()
    assert os.listdir(tmp_path) == []
    SaveDirLock.acquire(str(tmp_path)).release()


def test_a_live_holder_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, caplog):
    holder = hold(tmp_path)
    try:
        with pytest.raises(SaveDirInUse, match=f"pid {holder.pid}, started .*wait for it to end") as refused:
            SaveDirLock.acquire(str(tmp_path))
        assert "\n" not in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="galaxy.train.checkpoint.lock"):
        lock = SaveDirLock.acquire(str(tmp_path))
    taken = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert len(taken) == 1 and f"pid {holder.pid}," in taken[0], taken
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_process_the_holder_started_shares_its_lock(tmp_path):
    """A rank the launcher started (an emulated cluster's rank 0 under RANK/WORLD_SIZE) is part of its run."""
    holder = hold(tmp_path, "child")
    try:
        assert holder.stdout.readline().strip() == "None"
    finally:
        holder.kill()
        holder.wait()


def test_an_owner_on_another_host_is_never_judged_ended(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "another-host", "pid": 1, "pid_start": None,
                                                  "started": "2026-12-01 10:00:00", "command": "pretrain_galaxy.py"}))
    with pytest.raises(SaveDirInUse, match=f"host another-host, pid 1, .*remove '{tmp_path / LOCK_FILE}'"):
        SaveDirLock.acquire(str(tmp_path))
