"""Benchmarks of Galaxy against the recipes people run (each file's docstring says what it measures)."""

import os
import sys


def line_buffered_output() -> None:
    """Every line this process prints reaches its file or pipe as it is printed, and so does every line of the
    Python processes it starts after (``PYTHONUNBUFFERED`` in their environment): a launch killed by a timeout
    leaves what it had printed (stdout to a file is otherwise block-buffered, and a killed process's buffer is
    lost)."""
    sys.stdout.reconfigure(line_buffering=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
