"""What a CLI shows people: logging set-up, a line per stage of long work, the one-line bad-input error, the
final summary (and its JSON)."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from typing import Optional


# The library modules whose work takes long (reading and tokenizing a corpus, training a tokenizer, profiling a
# cluster): each logs its stages at INFO, which a command shows on stderr (on rank 0) whatever --log_level says.
STAGE_LOGGERS = ("galaxy.data", "galaxy.planner.profile")


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, stages: bool = False) -> None:
    """Python logging at ``level``; ``stages``: the INFO lines of ``STAGE_LOGGERS`` too."""
    logging.basicConfig(format=LOG_FORMAT)  # no-op where the process has its handlers (a local rank's)
    logging.getLogger().setLevel(getattr(logging, level.upper(), logging.WARNING))
    if stages:
        for name in STAGE_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))


def stage(text: str) -> None:
    """One line on stderr as a long piece of a command's own work starts or ends."""
    print(f"-- {text}", file=sys.stderr, flush=True)



def bad_input(error: Exception) -> int:
    """The one line a CLI prints for bad config, flags or files before any rank starts; exit code 2."""
    print(f"error: {error}", file=sys.stderr)
    return 2



def check_output_path(flag: str, path: Optional[str], directory: bool = False) -> None:
    """Make sure ``path`` (the value of ``--flag``) can be written before any rank starts: its directory
    (``directory``: the path itself) is created when missing; a file where a directory belongs, or the
    reverse, or a place that cannot be created or written, is one ``ConfigError`` naming the flag."""
    from galaxy.config import ConfigError

    if not path:
        return
    folder = path if directory else os.path.dirname(os.path.abspath(path))
    if directory and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--{flag} '{path}' is a file, and it must be a directory; pass a directory path")
    if not directory and os.path.isdir(path):
        raise ConfigError(f"--{flag} '{path}' is a directory, and it must be a file; pass a file path")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--{flag} '{path}': cannot create the directory '{folder}' ({e.strerror}); "
                          "pass a path in a writable place") from None
    try:  # a file made and removed there: permissions alone do not say it (root, read-only mounts, /proc)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"--{flag} '{path}': cannot write in '{folder}' ({e.strerror}); pass a path in a "
                          "writable place") from None


def check_output_flags(options, rank0_here: bool, rank0_files: Optional[dict[str, Optional[str]]] = None) -> None:
    """A run's output flags (``RunOptions``), each writable (``check_output_path``) before any rank starts: the
    files rank 0 alone writes (and a command's own, ``rank0_files``: flag -> path) where this launch starts rank
    0 (``rank0_here``), the checkpoint directory, of which every rank writes a part, everywhere;
    ``--tensorboard`` needs the tensorboard package."""
    if options.tensorboard:
        from galaxy.train.metrics import check_tensorboard_installed

        check_tensorboard_installed()
    if rank0_here:
        files = {"metrics_file": options.metrics_file, "summary_json": options.summary_json,
                 "profile_json": options.profile_json, **(rank0_files or {})}
        for flag, path in files.items():
            check_output_path(flag, path)
        check_output_path("tensorboard", options.tensorboard, directory=True)
    check_output_path("save_dir", options.save_dir, directory=True)



def print_summary(title: str, fields: dict, path: Optional[str]) -> None:
    width = max(len(k) for k in fields)
    print(f"\n== {title} ==")
    for k, v in fields.items():
        print(f"  {k:<{width}}  {v}")
    if path:
        with open(path, "w") as f:
            json.dump(fields, f, indent=2)
