"""Runs a user can trust (issue 48): the local launcher's ranks die with it however it dies, one run per
save directory, Ctrl-C stops every rank after a saved step and the run resumes exactly, and a save that
fails on a full disk says so in one line and keeps the last good checkpoint. Real CLI processes on
CPU/Gloo, a tiny BERT."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from galaxy.train.checkpoint.files import is_complete
from tests import REPO
from tests.in_process import run_script
from tests.train.checkpoint.helpers import checkpoint_tensors
from tests.train.test_save_failures import mounted_tmpfs

TINY = ["--no_progress", "--override", "global_batch_size=4", "--override", "seq_length=16", "--override",
        "hidden_size=32", "--override", "num_attention_heads=2", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1"]
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
DEADLINE_S = 300  # for a run to reach a step on a loaded two-core machine, not a verdict


def run(args: list[str], timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    """The CLI run to its end, in this process (tests.in_process: a new interpreter would only import torch and
    Galaxy again; its ranks are processes of their own). Runs that get signals or kills are ``start``ed."""
    return run_script(["pretrain_galaxy.py", *args], env={"OMP_NUM_THREADS": "1"}, timeout=timeout)


def start(args: list[str]) -> subprocess.Popen:
    """The CLI in a session of its own, as a terminal runs a job: its process group is the launcher's pid."""
    return subprocess.Popen([sys.executable, "pretrain_galaxy.py", *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def wait_until(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"the run never got to {what}"
        time.sleep(0.05)


def steps_logged(metrics) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def stat_fields(pid) -> list[str] | None:
    """A process's /proc stat fields after its name (state, parent, group, session, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes of a session: the launcher's, its ranks' and multiprocessing's resource
    tracker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = stat_fields(pid)
        if fields is not None and int(fields[3]) == session and fields[0] != "Z":
            found.append(int(pid))
    return found


def complete_checkpoints(save_dir) -> set[str]:
    return {d.name for d in save_dir.iterdir() if is_complete(str(d))}


def describe(pids: list[int]) -> str:
    """Each process as pid, parent, state and command line: which part of the run it is."""
    described = []
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        described.append(f"pid {pid} (parent {fields[1]}, state {fields[0]}): {command[:300]}")
    return "; ".join(described)


def test_ranks_die_with_their_launcher_when_it_is_killed(tmp_path):
    """``kill -9`` of the launcher: within 5 s no rank (and no resource tracker) is left, so nothing trains
    on or rotates away the checkpoints that were there at the kill (those complete as the launcher is reaped:
    on a loaded host the ranks may save and rotate several times between the second checkpoint and the kill;
    a save or rotation in flight at the kill may finish, so at most one checkpoint comes and the oldest goes)."""
    save_dir = tmp_path / "ckpt"
    launcher = start(["--world", "2", "--max_steps", "100000", "--save_dir", str(save_dir), "--save_every", "1",
                      "--keep_last", "3", *TINY])
    try:
        wait_until(lambda: save_dir.exists() and any(d.name == "step_000002" for d in save_dir.iterdir()), launcher,
                   "its second checkpoint")
        assert len(session_members(launcher.pid)) >= 3, "the launcher and its two ranks run"
        launcher.kill()
        launcher.wait()
        at_kill = complete_checkpoints(save_dir)
        killed_at = time.monotonic()
        while session_members(launcher.pid) and time.monotonic() - killed_at < 5:
            time.sleep(0.05)
        left = session_members(launcher.pid)
        assert left == [], f"processes of the run outlived its launcher by 5 s: {describe(left)}"
    finally:
        for pid in session_members(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    after = complete_checkpoints(save_dir)
    assert at_kill, "a checkpoint was complete at the kill"
    assert len(after - at_kill) <= 1, f"checkpoints written after the kill: {sorted(after - at_kill)}"
    assert at_kill - after <= {min(at_kill)}, f"checkpoints rotated away after the kill: {sorted(at_kill - after)}"


HOLD_THE_LOCK = """
import sys, time
from galaxy.train.checkpoint.lock import SaveDirLock
SaveDirLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_a_save_dir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(save_dir)], env=ENV, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        metrics = tmp_path / "m.jsonl"
        out = run(["--world", "2", "--max_steps", "1", "--save_dir", str(save_dir), "--metrics_file", str(metrics),
                   *TINY])
        assert out.returncode == 2, out.stderr[-3000:]
        assert len(lines(out.stderr)) == 1, out.stderr
        assert f"save directory '{save_dir}' is in use by another run (host {socket.gethostname()}, pid {holder.pid}," \
               in out.stderr, out.stderr
        assert not metrics.exists() and not any(d.name.startswith("step_") for d in save_dir.iterdir()), \
            "no rank started"
    finally:
        holder.kill()
        holder.wait()
    out = run(["--world", "2", "--max_steps", "1", "--save_dir", str(save_dir), *TINY])
    assert out.returncode == 0, out.stderr[-3000:]
    taken = [line for line in lines(out.stderr) if "taking over the lock" in line]
    assert len(taken) == 1 and f"pid {holder.pid}," in taken[0], out.stderr
    assert sorted(d.name for d in save_dir.iterdir()) == ["step_000001"], "the lock is gone with its run"


def test_ctrl_c_stops_every_rank_after_a_saved_step_and_the_run_resumes_exactly(tmp_path):
    """SIGINT to the run's process group (what Ctrl-C sends): one line, exit 130, a checkpoint of the step
    every rank stopped after; resumed, two more steps give the uninterrupted run's tensors (weights and
    AdamW moments, float64, dropout on) bit for bit."""
    model = ["--override", "dtype=float64", "--override", "hidden_dropout_prob=0.1", "--override",
             "lr_schedule=constant", "--world", "2", *TINY]
    interrupted, metrics = tmp_path / "interrupted", tmp_path / "m.jsonl"
    launcher = start(["--max_steps", "100000", "--save_dir", str(interrupted), "--metrics_file", str(metrics), *model])
    try:
        wait_until(lambda: steps_logged(metrics) >= 2, launcher, "step 2")
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=DEADLINE_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, err[-3000:]
    step = steps_logged(metrics)
    saved = interrupted / f"step_{step:06d}"
    assert lines(err) == [f"interrupted at step {step}; checkpoint '{saved}' saved; resume with --resume"], err
    assert sorted(d.name for d in interrupted.iterdir()) == [saved.name]

    out = run(["--max_steps", str(step + 2), "--save_dir", str(interrupted), "--resume", *model])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from checkpoint '{saved}' at step {step}" in out.stdout, out.stdout
    whole = tmp_path / "whole"
    out = run(["--max_steps", str(step + 2), "--save_dir", str(whole), *model])
    assert out.returncode == 0, out.stderr[-3000:]
    final = f"step_{step + 2:06d}"
    expected, got = checkpoint_tensors(str(whole / final)), checkpoint_tensors(str(interrupted / final))
    assert set(got) == set(expected) and any(k.startswith("optim/") for k in got)
    assert all(t.dtype == torch.float64 for k, t in got.items() if k.startswith("model/"))
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, f"the resumed run differs from the uninterrupted one in {differ[:3]}"


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB tmpfs: one checkpoint of TINY (about 0.7 MB) fits, a second does not."""
    with mounted_tmpfs(tmp_path / "tmpfs", "1m") as mount:
        yield mount


def test_a_save_that_fills_the_disk_fails_in_one_line_and_keeps_the_last_good_checkpoint(full_disk, tmp_path):
    out = run(["--world", "2", "--max_steps", "3", "--save_dir", str(full_disk), "--save_every", "1", *TINY])
    assert out.returncode == 1, out.stderr[-3000:]
    said = lines(out.stderr)
    assert len(said) == 1, out.stderr
    kept = full_disk / "step_000001"
    assert said[0].startswith(f"error: saving checkpoint '{full_disk / 'step_000002'}' failed: no space left on the "
                              "device"), said[0]
    assert f"a checkpoint needs about {sum(f.stat().st_size for f in kept.iterdir())} bytes" in said[0], said[0]
    assert f"the last good checkpoint '{kept}' is kept" in said[0], said[0]
    assert sorted(d.name for d in full_disk.iterdir()) == ["step_000001"], "no temporary directory, no lock"

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(full_disk, elsewhere)
    metrics = tmp_path / "m.jsonl"
    out = run(["--world", "1", "--max_steps", "3", "--save_dir", str(elsewhere), "--resume", "--metrics_file",
               str(metrics), *TINY])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from checkpoint '{elsewhere / 'step_000001'}' at step 1 of 3" in out.stdout, out.stdout
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [2, 3]
