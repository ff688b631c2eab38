"""Checkpoint directories: automatic names, the newest complete one, retention, atomic commit,
damaged checkpoints set aside."""
from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from typing import List, Optional, Tuple

from ..errors import CheckpointError
from .manifest import MANIFEST, read_manifest_document

CHECKPOINTS = "checkpoints"
_AUTO_NAME = re.compile(r"^checkpoint_(\d+)$")
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
DEL_MARK = ".del-"
# What a save leaves beside its checkpoint NAME while it runs: ``.NAME.tmp-TOKEN`` (the directory
# being written) and ``.NAME.old-TOKEN`` (the replaced checkpoint, between commit's renames); and
# what retention leaves while it deletes ``checkpoint_N``: ``.checkpoint_N.del-TOKEN``.
# TOKEN is 12 hex digits (for a save, the token the processes agree on: `CheckpointManager.begin`);
# cleanup matches these names whole, so it never takes ``.npm.tmp-cache`` or ``.config.old-2024`` for ours.
_LEFTOVER = re.compile(r"\.(?P<name>.+)(?P<mark>\.tmp-|\.old-|\.del-)[0-9a-f]{12}")
# A damaged checkpoint that an automatic load skipped (`set_aside_damaged`): ``checkpoint_N.damaged``
# (``checkpoint_N.damaged-2``... when that name is taken). `_AUTO_NAME` does not match it, so it is
# never listed, loaded or counted by retention; `highest_number` counts it, so N is never reused;
# it has no leading dot, so cleanup never takes it for a leftover.
DAMAGED_MARK = ".damaged"
_DAMAGED = re.compile(r"^checkpoint_(\d+)\.damaged(?:-(\d+))?$")


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
    """The highest N of any ``checkpoint_N`` entry, complete or not, or set aside as damaged
    (``checkpoint_N.damaged``): a new save never collides with one nor reuses its number."""
    if not os.path.isdir(folder):
        return None
    names = os.listdir(folder)
    numbers = [int(m.group(1)) for m in map(_AUTO_NAME.match, names) if m]
    numbers += [int(m.group(1)) for m in map(_DAMAGED.match, names) if m]
    return max(numbers) if numbers else None


def number_taken(folder: str, number: int) -> bool:
    """Whether ``checkpoint_{number}`` of ``folder`` exists (committed or not) or was set aside as
    damaged: automatic naming never writes there, whatever a listing said before.

    Example:
        >>> number_taken("runs/exp1/checkpoints", 3)
        False
    """
    if os.path.lexists(os.path.join(folder, f"checkpoint_{number}")):
        return True
    return any(m and int(m.group(1)) == number for m in map(_DAMAGED.match, _entries(folder)))


def _entries(folder: str) -> List[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def damaged_checkpoints(folder: str) -> List[Tuple[int, str]]:
    """The checkpoints of ``folder`` set aside as damaged (`set_aside_damaged`), by N then name.

    Example:
        >>> damaged_checkpoints("runs/exp1/checkpoints")
        [(2, 'runs/exp1/checkpoints/checkpoint_2.damaged')]
    """
    found = []
    for name in _entries(folder):
        match = _DAMAGED.match(name)
        if match and _is_directory(os.path.join(folder, name)):
            found.append((int(match.group(1)), int(match.group(2) or 1), os.path.join(folder, name)))
    return [(n, path) for n, _, path in sorted(found)]


def set_aside_damaged(checkpoint: str) -> str:
    """Rename the damaged ``checkpoint`` (``.../checkpoint_N``) to ``checkpoint_N.damaged`` (or
    ``checkpoint_N.damaged-2``, ``-3``... when taken), whole and atomically, and make the rename
    durable; returns the new path. Nothing in it is changed or deleted: listing, loading and
    retention skip it, automatic naming never reuses N, and cleanup never touches it.

    Example:
        >>> set_aside_damaged("runs/exp1/checkpoints/checkpoint_2")
        'runs/exp1/checkpoints/checkpoint_2.damaged'
    """
    parent, name = os.path.split(os.path.abspath(checkpoint))
    taken = set(_entries(parent))
    aside, count = f"{name}{DAMAGED_MARK}", 1
    while aside in taken:
        count += 1
        aside = f"{name}{DAMAGED_MARK}-{count}"
    target = os.path.join(os.path.dirname(checkpoint), aside)
    os.rename(checkpoint, target)
    _fsync_dir(parent)
    return target


def make_dirs(path: str) -> List[str]:
    """``os.makedirs(path, exist_ok=True)``, durable: each folder it created is fsynced, and so is
    the parent of the topmost one (which holds its name), so a power loss after a save returns
    cannot lose the tree the save created. Returns the folders it created, topmost first (none
    that another process created meanwhile: that one makes its own durable).

    Example:
        >>> make_dirs("runs/new/checkpoints")      # runs/ existed
        ['runs/new', 'runs/new/checkpoints']
    """
    missing, at = [], os.path.abspath(path)
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    created = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not os.path.isdir(folder):
                raise
            continue
        created.append(folder)
    for folder in reversed(created):
        _fsync_dir(folder)
    if created:
        _fsync_dir(os.path.dirname(created[0]))
    return created


def temporary_dir(final: str, token: str) -> str:
    """``{parent}/.{name}.tmp-{token}`` for the checkpoint ``final``; ``token``: 12 hex digits."""
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


def _is_directory(path: str) -> bool:
    """A real directory (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_checkpoint(path: str) -> bool:
    """A real directory holding a regular ``manifest.json`` (committed; contents not verified)."""
    try:
        return _is_directory(path) and stat.S_ISREG(os.lstat(os.path.join(path, MANIFEST)).st_mode)
    except OSError:
        return False


def _set_aside(final: str) -> Optional[str]:
    """The checkpoint `commit` set aside for ``final`` when ``final`` vanished between its two
    renames, or None."""
    parent, name = os.path.split(os.path.abspath(final))
    if os.path.lexists(final) or not os.path.isdir(parent):
        return None
    for entry in sorted(os.listdir(parent)):
        match = _LEFTOVER.fullmatch(entry)
        if (match and match["mark"] == OLD_MARK and match["name"] == name
                and _is_checkpoint(os.path.join(parent, entry))):
            return os.path.join(parent, entry)
    return None


def set_aside_exists(final: str) -> bool:
    """Whether `recover` would put a checkpoint back as ``final``."""
    return _set_aside(final) is not None


def recover(final: str) -> None:
    """If ``final`` vanished between `commit`'s two renames, restore the replaced checkpoint."""
    found = _set_aside(final)
    if found is not None:
        os.rename(found, final)


def _is_stale(parent: str, entry: str) -> bool:
    """Whether ``entry`` of ``parent`` is a save's leftover that is safe to delete: a directory
    named exactly as `_LEFTOVER` says, beside the committed checkpoint it belongs to (a replaced
    one's only copy, ``.NAME.old-TOKEN`` without NAME, is kept for `recover`), or the temporary
    directory of an automatically named checkpoint (``.checkpoint_N.tmp-TOKEN``) that crashed."""
    match = _LEFTOVER.fullmatch(entry)
    if match is None or match["name"] in (".", "..") or not _is_directory(os.path.join(parent, entry)):
        return False
    if match["mark"] == DEL_MARK:  # a checkpoint retention began to delete (`delete_checkpoint`)
        return _AUTO_NAME.match(match["name"]) is not None
    if _is_checkpoint(os.path.join(parent, match["name"])):
        return True
    return match["mark"] == TMP_MARK and _AUTO_NAME.match(match["name"]) is not None


def remove_stale_temporaries(parent: str) -> None:
    """Delete what crashed saves left (called by the main process after a commit): temporary
    directories, set-aside old checkpoints whose replacement is in place, and what a failed
    retention delete left. Only names a save or retention creates are touched (see `_is_stale`);
    anything else in ``parent`` is left alone, checkpoints set aside as damaged among them."""
    if not os.path.isdir(parent):
        return
    for entry in os.listdir(parent):
        if _is_stale(parent, entry):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def foreign_entries(directory: str) -> List[str]:
    """Entries of an existing ``directory`` that a checkpoint did not write (empty: safe to replace)."""
    if not os.path.isdir(directory):
        return []
    names = os.listdir(directory)
    if not names:
        return []
    try:  # bounded, and never blocks on a FIFO in the manifest's place
        document = read_manifest_document(os.path.join(directory, MANIFEST))
    except (CheckpointError, OSError):
        return sorted(names)
    files = document.get("files") if isinstance(document, dict) else None
    if not isinstance(files, dict):
        return sorted(names)
    listed = {name.split("/")[0] for name in files} | {MANIFEST}
    return sorted(n for n in names if n not in listed)


def delete_checkpoint(path: str) -> None:
    """Delete the checkpoint ``path``: first renamed to ``.NAME.del-TOKEN`` (atomic: from then on
    it is never listed or loaded, so no failure below leaves a manifest whose files are gone),
    then removed. Raises `OSError` when either fails; what a failed removal left is deleted by
    `remove_stale_temporaries` after the next commit.

    Example:
        >>> delete_checkpoint("runs/exp1/checkpoints/checkpoint_0")
    """
    parent, name = os.path.split(os.path.abspath(path))
    hidden = os.path.join(parent, f".{name}{DEL_MARK}{uuid.uuid4().hex[:12]}")
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def apply_retention(folder: str, total_limit: Optional[int], keep: str) -> List[str]:
    """Delete the oldest committed checkpoints beyond ``total_limit``, never ``keep`` nor a
    checkpoint set aside as damaged (`delete_checkpoint`: out of the listing first); raises
    `OSError` when a delete fails."""
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
        delete_checkpoint(path)
        removed.append(path)
        excess -= 1
    return removed


def fsync_tree(directory: str) -> None:
    """Flush every file below ``directory``, then every folder from the deepest up, then its
    parent (which holds the name): after it, the checkpoint survives a power loss."""
    for folder, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder, _, _ in sorted(os.walk(directory), key=lambda entry: -entry[0].count(os.sep)):
        _fsync_dir(folder)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
