"""One live run per checkpoint folder: an exclusive lock that the main process holds while it saves.

Two runs that share a ``project_dir`` with automatic naming would both pick ``checkpoint_N``,
delete each other's temporary directories and replace each other's checkpoints. The main
process of a run therefore holds an advisory ``flock`` on ``<project_dir>/.unified.lock`` from its
first save until ``end_training`` (or its exit: the kernel drops the lock with the process, so
a crashed run never leaves the folder locked). The file names the holder, for the error that
the second run gets. Accelerators of one process share the lock: they are the same run.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import threading
from typing import Dict, Tuple

from ..errors import CheckpointError, see

LOCK_NAME = ".unified.lock"

_HELD: Dict[str, Tuple[int, int]] = {}  # real folder path -> (file descriptor, holders in this process)
_GUARD = threading.Lock()


def acquire(folder: str) -> str:
    """Hold the lock of ``folder`` for this process (again, if it already does); returns the key
    to `release` it with. Raises `CheckpointError` naming the holder when another process does."""
    os.makedirs(folder, exist_ok=True)
    key = os.path.realpath(folder)
    with _GUARD:
        if key in _HELD:
            fd, count = _HELD[key]
            _HELD[key] = (fd, count + 1)
            return key
        path = os.path.join(key, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            raise CheckpointError(
                f"{folder}: another live run saves checkpoints here ({holder}); two runs sharing a folder would "
                "overwrite each other's checkpoints. Give each run its own project_dir, or stop the other run."
                + see("folder-in-use")
            ) from None
        note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": datetime.datetime.now().isoformat(timespec="seconds")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode(), 0)
        _HELD[key] = (fd, 1)
        return key


def release(key: str) -> None:
    """Give up one hold taken by `acquire`; the last one unlocks the folder."""
    with _GUARD:
        if key not in _HELD:
            return
        fd, count = _HELD[key]
        if count > 1:
            _HELD[key] = (fd, count - 1)
            return
        del _HELD[key]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
