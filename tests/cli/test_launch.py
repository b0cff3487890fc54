"""The local launcher's children (``--world N`` without ``--rank``) end with ``os._exit``: what a rank
printed or logged still arrives, and the exit code still tells the launcher how the rank ended."""

from __future__ import annotations

import logging

from galaxy.cli.launch import Launch, launch_ranks
from galaxy.cli.plan import failure_said
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
    said = failure_said(err)  # what plan_galaxy.py --validate logs of a failed plan: the rank's reason first
    assert said.startswith("error (rank 1): rank 1 fails on purpose / error: rank 1 exited"), said


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


# Threads of a Gloo process group (its workers and transport loop) and of rank 0's store server.
GROUP_THREADS = ("pt_gloo", "gloo_tcp", "pt_tcpstore")


def native_threads() -> list[str]:
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that just ended
            pass
    return names


def shut_down_and_list_threads(rank: int, launch: Launch, payload) -> None:
    """A rank with mp over both ranks (the WORLD group and mp_grad's own) that runs collectives on
    them, shuts its context down and, with the context still alive (a model or trainer holds it in a
    CLI rank), fails when a group's threads still run."""
    import torch
    import torch.distributed as dist

    from galaxy.config import DistributedConfig
    from galaxy.core.context import ParallelContext

    ctx = ParallelContext.initialize(DistributedConfig(init_method=launch.init_method, timeout_s=60), rank,
                                     launch.world, "cpu")
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401  as a ZeRO run's optimizer does
    x = torch.ones(4)
    ctx.mp.all_reduce(x)  # the first eager functional collective imports torch._dynamo
    ctx.mp_grad.all_reduce(x)
    gathered = [torch.empty(4) for _ in range(launch.world)]
    dist.all_gather(gathered, x, group=ctx.mp.group)  # as Trainer.gather_over_stages
    del gathered
    ctx.shutdown()
    left = [t for t in native_threads() if t.startswith(GROUP_THREADS)]
    if left:
        raise ValueError(f"threads still running after shutdown: {sorted(left)}")
    assert ctx.mp.size == launch.world  # the context still describes the rank


def test_shutdown_ends_the_gloo_threads_while_the_context_lives(capfd):
    """A Gloo group's threads left running after shutdown are destroyed in interpreter finalization,
    where one aborted ranks ("terminate called without an active exception"): shutdown ends them."""
    code = launch_ranks(shut_down_and_list_threads, Launch(2, None, None, None), None, GalaxyConfig())
    assert code == 0, capfd.readouterr().err[-2000:]


def warn_from_every_rank(rank: int, launch: Launch, payload) -> None:
    """A launcher child: the same warning on every rank (twice: each time is a warning of its own), one that
    names its rank, and a Python ``warnings`` one."""
    import warnings

    log = logging.getLogger("galaxy.test_launch")
    for _ in range(2):
        log.warning("vocab_size set to 96 to match the tokenizer")
    log.warning("rank %d is rank %d", rank, rank)
    warnings.warn("a library's warning, the same on every rank")


def test_a_warning_every_rank_gives_prints_once(capfd):
    assert launch_ranks(warn_from_every_rank, Launch(2, None, None, None), None, GalaxyConfig()) == 0
    err = capfd.readouterr().err
    assert err.count("vocab_size set to 96 to match the tokenizer") == 2, err
    assert err.count("UserWarning: a library's warning, the same on every rank") == 1, err
    for rank in (0, 1):
        assert f"rank {rank} is rank {rank}" in err, err


# A launcher whose child, told the launcher's pid, runs only the fallback watch (no PR_SET_PDEATHSIG).
WATCHED_CHILD = """
import os, subprocess, sys, time
if sys.argv[1] == "launcher":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(os.getpid()), sys.argv[2]])
    print(child.pid, flush=True)
    time.sleep(600)
else:
    import threading
    from galaxy.cli.launch import watch_launcher
    threading.Thread(target=watch_launcher, args=(int(sys.argv[1]), 0.1), daemon=True).start()
    print("watching", flush=True)
    time.sleep(600)
"""


def test_the_parent_watch_ends_a_rank_whose_launcher_died():
    """Where ``PR_SET_PDEATHSIG`` is not (not Linux): the watch thread alone ends the orphan within 5 s."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONPATH=REPO)
    launcher = subprocess.Popen([sys.executable, "-c", WATCHED_CHILD, "launcher", WATCHED_CHILD], env=env,
                                stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "watching"
        launcher.kill()
        launcher.wait()
        killed_at = time.monotonic()
        while alive(child) and time.monotonic() - killed_at < 5:
            time.sleep(0.05)
        assert not alive(child), "the rank outlived its launcher by 5 s"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


# A launcher, a forkserver it starts (without a parent-death signal: it outlives the launcher here, as the real one
# does until the kernel runs it to its death) and a rank the forkserver starts, which checks for its launcher.
FORKSERVER_TREE = """
import os, subprocess, sys, time
role, code = sys.argv[1], sys.argv[2]
if role != "rank":
    launcher = str(os.getpid()) if role == "launcher" else sys.argv[3]
    subprocess.Popen([sys.executable, "-c", code, "forkserver" if role == "launcher" else "rank", code, launcher])
    time.sleep(600)
try:
    from galaxy.train.interrupts import Interrupts, LauncherGone
    interrupts = Interrupts(launcher_pid=int(sys.argv[3]))
    interrupts.check_launcher()
    print("alive", flush=True)
    hang_guard = time.monotonic() + 120
    while time.monotonic() < hang_guard:
        interrupts.check_launcher()
        time.sleep(0.05)
    print("still running 120 s later", flush=True)
except LauncherGone as e:
    print(e, flush=True)
except BaseException as e:
    print(repr(e), flush=True)
"""


def test_a_rank_forked_from_a_forkserver_stops_writing_once_its_launcher_dies():
    """A rank forked from the launcher's forkserver is the forkserver's child; the forkserver's parent-death signal
    ends it, and then the rank, only once the kernel runs it, and on a busy host the rank trained and saved three more
    steps in between (the whole suite beside a busy loop, 2026-12-04). ``check_launcher``, before every checkpoint
    write, looks past the forkserver: while the launcher lives the rank goes on, once it is gone the rank says so."""
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=REPO)
    launcher = subprocess.Popen([sys.executable, "-c", FORKSERVER_TREE, "launcher", FORKSERVER_TREE], env=env,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert launcher.stdout.readline().strip() == "alive"
        launcher.kill()
        launcher.wait()
        said = launcher.stdout.readline().strip()
        assert said.startswith(f"the launcher (pid {launcher.pid}) that started this rank is gone"), said
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the forkserver and the rank, in the launcher's session


def alive(pid: int) -> bool:
    """Running (not a zombie left for an init that does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_ctrl_c_outside_the_ranks_is_one_line_and_exit_130(capsys):
    """Every CLI's main ends a KeyboardInterrupt raised before its ranks start (reading a config, a checkpoint's
    config, data in the launcher) with one line and 130, the code of an interrupted run, not a traceback."""
    import importlib

    from galaxy.cli.launch import INTERRUPTED, interruptible
    from galaxy.cli.main import COMMANDS

    @interruptible
    def reading_config(argv):
        raise KeyboardInterrupt

    assert reading_config([]) == INTERRUPTED
    err = capsys.readouterr().err
    assert err == "interrupted before a training step ended; nothing was saved\n", err
    for command in COMMANDS:
        main = importlib.import_module(f"galaxy.cli.{command}").main
        assert getattr(main, "__wrapped__", None) is not None, f"galaxy {command}'s main is not interruptible"
