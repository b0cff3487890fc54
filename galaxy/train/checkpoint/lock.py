"""One run per save directory: ``run.lock`` names the run that writes checkpoints there.

Two runs saving into one directory would overwrite and prune each other's checkpoints, each exiting 0.
The process that owns a run (the local launcher, or the process of rank 0 under ``torchrun`` and
``--rank 0``) takes the lock before any rank starts and removes it on its way out; a second run
refuses to start, naming the first (host, pid, start time).

The lock is the file's ``flock``, which the kernel drops when its holder dies however it dies, and the
file's content says who holds it (JSON: host, pid, the pid's start time, when, the command). A file
whose lock is free names a run that ended without removing it (``kill -9``): it is taken over, with
one warning. Where the file system has no ``flock``, a same-host owner whose pid is gone (or is
another process now) counts as ended. An owner on another host is never judged ended: the refusal
says which file to remove if it is.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

from galaxy.errors import UserError

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class SaveDirInUse(UserError):
    """Another run holds the save directory's lock; the message names it (one line)."""


def _process_start(pid: int) -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (Linux ``/proc``): tells a pid from a later process
    that reuses it. None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22; the name in parentheses may hold spaces


def parent_of(pid: int) -> Optional[int]:
    """The parent of process ``pid`` (Linux ``/proc``); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


@dataclass
class Owner:
    """The run that holds a lock, as its file says."""

    host: str
    pid: int
    pid_start: Optional[int]
    started: str
    command: str

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), _process_start(os.getpid()),
                   time.strftime("%Y-%m-%d %H:%M:%S"), " ".join(sys.argv))

    @classmethod
    def parse(cls, text: str) -> Optional["Owner"]:
        """The owner a lock file names; None for an empty or unreadable one (a holder that has not written
        it yet, or a crash while writing)."""
        try:
            raw = json.loads(text)
            return cls(str(raw["host"]), int(raw["pid"]), raw.get("pid_start"), str(raw.get("started", "?")),
                       str(raw.get("command", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def __str__(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether the owner's process still runs (asked on its own host only)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            pass
        start = _process_start(self.pid)
        return start is None or self.pid_start is None or start == self.pid_start

    def is_ancestor(self) -> bool:
        """Whether the owner started this process (directly or not): the launcher of this rank, whose lock
        covers the run this process is part of."""
        if not self.on_this_host():
            return False
        pid = os.getppid()
        while pid and pid > 1:
            if pid == self.pid:
                return self.pid_start is None or _process_start(pid) == self.pid_start
            pid = parent_of(pid)
        return False


def _flock(fd: int) -> Optional[bool]:
    """Try the exclusive lock without waiting: True when taken, False when another holds it, None where the
    file system has no ``flock``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


class SaveDirLock:
    """The held lock of a save directory (``acquire``); ``release`` removes it."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, directory: str) -> Optional["SaveDirLock"]:
        """Take ``directory``'s lock for this process, or raise ``SaveDirInUse`` naming the run that holds
        it. None when the holder is a process that started this one (its launcher: the same run)."""
        path = os.path.join(directory, LOCK_FILE)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                held = _flock(fd)
                previous = Owner.parse(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
                if previous is not None and previous.is_ancestor():
                    os.close(fd)
                    return None
                if held is False or (previous is not None and not previous.on_this_host()) or \
                        (held is None and previous is not None and previous.alive()):
                    who = f"({previous})" if previous is not None else "(starting now)"
                    remove = "" if held is False else f"; if that run has ended, remove '{path}'"
                    raise SaveDirInUse(f"save directory '{directory}' is in use by another run {who}: two runs would "
                                       f"overwrite each other's checkpoints; wait for it to end or use another save "
                                       f"directory{remove}")
                if not _same_file(fd, path):  # its last holder removed it after we opened it: open the new one
                    os.close(fd)
                    continue
                if previous is not None:
                    logger.warning("taking over the lock of save directory '%s' from a run that ended without "
                                   "releasing it (%s)", directory, previous)
                data = json.dumps(asdict(Owner.this_process())).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                return cls(path, fd)
            except BaseException:
                try:
                    os.close(fd)
                except OSError:  # closed above
                    pass
                raise

    def release(self) -> None:
        """Remove the lock file (while still holding its lock: no one takes a file about to vanish), then
        let go of it."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        except OSError as e:  # a save directory removed or made read-only under the run
            logger.warning("could not remove the lock file '%s' (%s)", self.path, e)
        finally:
            os.close(self._fd)
            self._fd = None
