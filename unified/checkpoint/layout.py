"""Checkpoint directories: automatic names, the newest complete one, retention, atomic commit."""
from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional, Tuple

from .manifest import MANIFEST

CHECKPOINTS = "checkpoints"
_AUTO_NAME = re.compile(r"^checkpoint_(\d+)$")
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


def automatic_dir(project_dir: str, iteration: int) -> str:
    """``{project_dir}/checkpoints/checkpoint_{iteration}``."""
    return os.path.join(project_dir, CHECKPOINTS, f"checkpoint_{iteration}")


def numbered_checkpoints(folder: str) -> List[Tuple[int, str]]:
    """Committed ``checkpoint_N`` directories in ``folder`` (those with a manifest), sorted by N.

    Temporary and half-replaced directories never match: they carry a leading dot.
    """
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = _AUTO_NAME.match(name)
        path = os.path.join(folder, name)
        if match and os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def highest_number(folder: str) -> Optional[int]:
    """The highest N of any ``checkpoint_N`` entry, complete or not (so a new save never collides)."""
    if not os.path.isdir(folder):
        return None
    numbers = [int(m.group(1)) for m in map(_AUTO_NAME.match, os.listdir(folder)) if m]
    return max(numbers) if numbers else None


def temporary_dir(final: str, token: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{TMP_MARK}{token}")


def commit(tmp: str, final: str, token: str) -> None:
    """Move the finished ``tmp`` directory to ``final`` atomically, replacing any old one whole.

    A rename cannot replace a non-empty directory, so an existing ``final`` is first renamed
    aside (``.NAME.old-TOKEN``), then ``tmp`` takes its name, then the old one is deleted.
    `recover` puts the old one back if a crash struck between the two renames.
    """
    parent, name = os.path.split(os.path.abspath(final))
    aside = os.path.join(parent, f".{name}{OLD_MARK}{token}")
    if os.path.lexists(final):
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(parent)
    if os.path.lexists(aside):
        shutil.rmtree(aside, ignore_errors=True)


def recover(final: str) -> None:
    """If ``final`` vanished between `commit`'s two renames, restore the replaced checkpoint."""
    parent, name = os.path.split(os.path.abspath(final))
    if os.path.lexists(final) or not os.path.isdir(parent):
        return
    for entry in sorted(os.listdir(parent)):
        if entry.startswith(f".{name}{OLD_MARK}") and os.path.isfile(os.path.join(parent, entry, MANIFEST)):
            os.rename(os.path.join(parent, entry), final)
            return


def remove_stale_temporaries(parent: str) -> None:
    """Delete temporary directories left by crashed saves (called by the main process only)."""
    if not os.path.isdir(parent):
        return
    for entry in os.listdir(parent):
        if entry.startswith(".") and TMP_MARK in entry:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def apply_retention(folder: str, total_limit: Optional[int], keep: str) -> List[str]:
    """Delete the oldest committed checkpoints beyond ``total_limit``; never ``keep``."""
    if not total_limit:
        return []
    committed = numbered_checkpoints(folder)
    excess = len(committed) - total_limit
    removed = []
    for _, path in committed:
        if excess <= 0:
            break
        if os.path.abspath(path) == os.path.abspath(keep):
            continue
        shutil.rmtree(path)
        removed.append(path)
        excess -= 1
    return removed


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
