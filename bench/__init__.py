"""Benchmarks of Galaxy against the recipes people run (each file's docstring says what it measures)."""

import atexit
import os
import sys
import threading


def line_buffered_output() -> None:
    """Every line this process prints reaches its file or pipe as it is printed, and so does every line of the
    Python processes it starts after (``PYTHONUNBUFFERED`` in their environment): a launch killed by a timeout
    leaves what it had printed (stdout to a file is otherwise block-buffered, and a killed process's buffer is
    lost)."""
    sys.stdout.reconfigure(line_buffering=True)
    os.environ["PYTHONUNBUFFERED"] = "1"


def exit_without_finalizing(code: int = 0) -> None:
    """End this process with ``code`` as Galaxy's ranks end (``galaxy.cli.launch._child``): what the interpreter's
    exit does that matters (the atexit handlers, logging's and multiprocessing's among them; the streams flushed),
    then ``os._exit``, which skips tearing every module down: with torch._dynamo imported that took 1.0-1.4 s of CPU
    a process (2026-12-03; a sweep's point and a contender's child are each one). While a non-daemon thread runs,
    a plain exit instead (the interpreter waits for it)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
