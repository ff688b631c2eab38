"""How a checkpoint's save or load fails: the errors that name every process's reason, and
which failures of a verification are damage of the checkpoint (`is_damage`: an automatic load
then goes on to an older one) rather than a checkpoint that does not fit this run.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

from ..errors import TROUBLESHOOTING, CheckpointError, see


def _raise_reported(final: str, reports: List[Dict[str, Any]]) -> None:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise CheckpointError(
            f"save_state({final!r}) failed and was not committed; the previous checkpoint is intact. "
            f"{'; '.join(errors)}" + see("save-failed")
        )


def _raise_failed(directory: str, failed: List[Tuple[int, str]]) -> None:
    """Raise, naming every process's reason, when any process (``(rank, reason)``) failed to load."""
    if failed:
        raise CheckpointError(f"{directory}: cannot be loaded; "
                              + "; ".join(f"process {rank}: {reason}" for rank, reason in failed)
                              + see("another-process-could-not-load"))


# What verification reports of a damaged checkpoint, by the troubleshooting anchor its error
# ends with (`see`): a checksum or size mismatch, a file that ends early, is empty, not
# safetensors, a link or special file; a manifest missing, unparseable, too costly, edited after it
# was written or naming files it may not; a structure or header no save writes (hostile). Only
# these make an automatic load go on to an older checkpoint (`CheckpointManager.load_newest`);
# anything else (the checkpoint does not fit this run, a newer format version, a store out of
# reach, a file that cannot be opened for another reason than its absence) is raised as it is.
DAMAGE_ANCHORS = frozenset({
    "checksum-mismatch", "size-mismatch", "file-ended", "empty-file", "invalid-safetensors", "header-too-large",
    "not-a-regular-file", "link-inside-checkpoint", "refusing-file-name", "manifest-missing", "manifest-too-large",
    "manifest-invalid", "manifest-too-costly", "manifest-modified", "manifest-field", "manifest-files",
    "manifest-format", "invalid-structure", "missing-array", "sharded-files-unlisted",
})

_ANCHOR = re.compile(r"#([A-Za-z0-9_-]+)\s*$")


def is_damage(error: BaseException) -> bool:
    """Whether ``error``, raised while a checkpoint was verified, says the checkpoint is damaged
    (see `DAMAGE_ANCHORS`) rather than that it does not fit this run or could not be reached. An
    error may say so itself (a ``damage`` attribute); a file that cannot be opened is damage
    only when it is missing.

    Example:
        >>> is_damage(safetensors_io.checksum_mismatch("ckpt/model_0.safetensors"))
        True
        >>> is_damage(CheckpointError("ckpt/model_0.safetensors: tensor 'w' is F32 [3]..." + see("tensor-mismatch")))
        False
    """
    said = getattr(error, "damage", None)
    if said is not None:
        return bool(said)
    if not isinstance(error, CheckpointError):
        return False
    found = _ANCHOR.search(str(error))
    anchor = found.group(1) if found else None
    if anchor == "cannot-open-file":
        return isinstance(error.__cause__, FileNotFoundError)
    return anchor in DAMAGE_ANCHORS


def _not_damage(error: CheckpointError) -> CheckpointError:
    """``error``, marked as no damage of the checkpoint (`is_damage`): a file changed while it was read."""
    error.damage = False  # type: ignore[attr-defined]
    return error


class DamagedCheckpoint(CheckpointError):
    """Raised on every process alike by a load that falls back (`CheckpointManager.load_newest`)
    when the only failures of its verification, on every process, were damage (`is_damage`):
    ``failed`` holds each process's ``(index, reason)``."""

    def __init__(self, directory: str, failed: List[Tuple[int, str]]) -> None:
        super().__init__(f"{directory}: damaged; " + _reasons(failed) + see("damaged-checkpoint-skipped"))
        self.directory, self.failed = directory, failed


_LINK = re.compile(r"\s*See " + re.escape(TROUBLESHOOTING) + r"#[A-Za-z0-9_-]+\s*$")


def _reasons(failed: List[Tuple[int, str]]) -> str:
    """Each process's reason, without the link to the troubleshooting page it ends with."""
    return "; ".join(f"process {rank}: {_LINK.sub('', reason)}" for rank, reason in failed)


def _commit_error(final: str, err: OSError, rank: int = 0) -> CheckpointError:
    return CheckpointError(f"save_state({final!r}) failed while committing and was not committed; the previous "
                           f"checkpoint is intact. process {rank}: {err}" + see("save-failed"))


def _retention_error(final: str, err: OSError) -> CheckpointError:
    return CheckpointError(f"save_state({final!r}) committed the checkpoint, but removing older ones "
                           f"(total_limit) or what crashed saves left failed: {_LINK.sub('', str(err))}. "
                           "A checkpoint leaves the listing before its files are deleted: none is left "
                           "half-deleted and still loadable." + see("retention-delete-failed"))


def damaged_while_placed(err: Exception, what: str) -> CheckpointError:
    """The error every process raises when a file failed its checks while ``what`` (an object,
    or "the sharded arrays") was read into place in one pass: damage of the checkpoint
    (`is_damage`, as ``err`` is), with the objects holding part of it."""
    reason = _LINK.sub("", str(err)) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    failure = CheckpointError(
        f"{reason} (found while {what} was read into place: the objects now hold part of this checkpoint); "
        "load it (or another) again before training. "
        "load_state(verify_first=True) verifies every file before it restores anything."
        + see("damaged-while-placed"))
    failure.damage = is_damage(err)  # type: ignore[attr-defined]
    return failure
