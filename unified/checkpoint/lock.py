"""One live run per checkpoint folder: an exclusive lock that the main process holds while it saves.

Two runs that share a ``project_dir`` with automatic naming would both pick ``checkpoint_N``,
delete each other's temporary directories and replace each other's checkpoints. The main
process of a run therefore holds an advisory ``flock`` on the ``project_dir`` directory itself
from its first save until ``end_training`` (or its exit: the kernel drops the lock with the
process, so a crashed run never leaves the folder locked). Nothing is added to the folder's
listing, which Accelerate scripts count: the holder's note, for the error that the second run
gets, is an extended attribute of the folder (``user.unified.holder``) where the file system
keeps them. Accelerators of one process share the lock: they are the same run.
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

HOLDER_ATTRIBUTE = "user.unified.holder"

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
        fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"{folder}: another live run saves checkpoints here ({_holder(key)}); two runs sharing a folder would "
                "overwrite each other's checkpoints. Give each run its own project_dir, or stop the other run."
                + see("folder-in-use")
            ) from None
        note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": datetime.datetime.now().isoformat(timespec="seconds")})
        try:
            os.setxattr(key, HOLDER_ATTRIBUTE, note.encode())
        except OSError:  # no extended attributes here: the second run's error names no holder
            pass
        _HELD[key] = (fd, 1)
        return key


def _holder(folder: str) -> str:
    """Who holds ``folder``, as the holder noted it (see `acquire`)."""
    try:
        return os.getxattr(folder, HOLDER_ATTRIBUTE).decode("utf-8", "replace").strip() or "an unknown process"
    except OSError:
        return "a process that left no note: this file system keeps no extended attributes"


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
        try:
            os.removexattr(key, HOLDER_ATTRIBUTE)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
