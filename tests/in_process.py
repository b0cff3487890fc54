"""A script run as ``python script.py ARGS`` runs it, but in the test's own process: ``run_script``.

A CLI launch started as a subprocess pays a Python interpreter that imports torch and Galaxy (about 3.5 s of
CPU on the 2-core test host, 2026-12-02) before it starts its ranks, which import them again anyway; the test
process has both imported already. The script still runs as ``__main__`` (runpy, as ``python script.py``
does), and a ``--world N`` launch still starts its N ranks as processes of their own (multiprocessing's spawn
re-imports the script in each, as under ``python``). What the process would show is shown: the exit code,
stdout and stderr at the file-descriptor level (the ranks' output included), warnings under Python's default
filters, the launcher's logging on stderr. Use it where the subprocess adds nothing a test checks: not for
signals or kills sent to the launcher, its process group, or a run of one rank in the launcher (``--world 1``
trains in the launcher, whose state would stay in the test's process)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import warnings

from tests import REPO


@contextlib.contextmanager
def _fd_output():
    """Everything written to fds 1 and 2 (and sys.stdout / sys.stderr) inside, by this process and its children:
    yields a dict that holds 'stdout' and 'stderr' once the block ends."""
    got: dict[str, str] = {}
    files = [tempfile.TemporaryFile() for _ in range(2)]
    streams = sys.stdout, sys.stderr
    for stream in streams:
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        try:
            yield got
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)
        for name, f in zip(("stdout", "stderr"), files):
            f.seek(0)
            got[name] = f.read().decode(errors="backslashreplace")
            f.close()


@contextlib.contextmanager
def _fresh_logging():
    """Logging as a new interpreter has it (no handlers, root at WARNING), restored afterwards: a CLI's
    ``logging.basicConfig`` then adds its stderr handler, as in its own process."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: lg.level for name, lg in logging.Logger.manager.loggerDict.items()
              if isinstance(lg, logging.Logger)}
    root.handlers[:] = []
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, lg in logging.Logger.manager.loggerDict.items():
            if isinstance(lg, logging.Logger):
                lg.setLevel(levels.get(name, logging.NOTSET))


@contextlib.contextmanager
def _default_warnings():
    """Python's default warning filters (a new interpreter's, without -W), shown on stderr."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = _show_on_stderr
        yield


def _show_on_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_script(argv: list[str], cwd: str = REPO, env: dict | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """``python argv[0] argv[1:]`` with ``PYTHONPATH`` at the checkout (and ``env`` added), in ``cwd``, run
    here: its exit code, stdout and stderr. Past ``timeout`` seconds the processes it started are killed (its
    launcher then ends, as a launch whose ranks die does); an exception the script does not catch is raised."""
    before = set(multiprocessing.active_children())

    def kill_its_children():
        for child in set(multiprocessing.active_children()) - before:
            child.kill()

    watchdog = threading.Timer(timeout, kill_its_children)
    watchdog.daemon = True
    saved_argv, saved_cwd, saved_env = sys.argv, os.getcwd(), dict(os.environ)
    code = 0
    try:
        os.environ.update(PYTHONPATH=REPO, **(env or {}))
        os.chdir(cwd)
        sys.argv = list(argv)
        watchdog.start()
        with _fd_output() as out, _fresh_logging(), _default_warnings():
            try:
                runpy.run_path(os.path.join(cwd, argv[0]), run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):  # printed on stderr, exit code 1, as the interpreter does
                    print(e.code, file=sys.stderr)
                    code = 1
                else:
                    code = e.code or 0
    finally:
        watchdog.cancel()
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(argv, code, out["stdout"], out["stderr"])
