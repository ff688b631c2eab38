"""Every exception `unified` raises on purpose.

Messages follow one rule: say what was expected, what happened, and what to do.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "UnifiedError",
    "DistributedError",
    "BarrierTimeout",
    "CheckpointError",
    "BackendUnavailable",
    "MissingCapability",
    "InvalidBackend",
    "TROUBLESHOOTING",
    "see",
]

TROUBLESHOOTING = "docs/troubleshooting.md"


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message, or its type name when it has none;
    what an error message quotes of the framework error that caused it."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


_SENTENCE_ENDS = (".", "?", "!")


class _Link(str):
    """What `see` returns: a str that, appended to a message (``message + see(...)``), first
    ends the message's last sentence with a full stop when it has none, so that no message
    reads "... directory See docs/...", whatever the message ends with (a quoted error, a path)."""

    __slots__ = ()

    def __radd__(self, message: object) -> str:
        if not isinstance(message, str):
            return NotImplemented
        text = message.rstrip()
        if text and not text.endswith(_SENTENCE_ENDS):
            text += "."
        return text + str(self)


def see(anchor: str) -> str:
    """The sentence appended to an error message that points to its troubleshooting section.

    Every message `unified` raises ends with it, so that a user can go from the message to the
    section of ``docs/troubleshooting.md`` that explains its causes and fixes. Appended with
    ``+``, it also ends the message's last sentence with a full stop where it has none.

    Args:
        anchor: the ``<a id="...">`` of the message's section in ``docs/troubleshooting.md``.

    Returns:
        ``" See docs/troubleshooting.md#<anchor>"``, with its leading space.

    Example:
        >>> see("barrier-timeout")
        ' See docs/troubleshooting.md#barrier-timeout'
        >>> "ckpt/manifest.json: missing" + see("manifest-missing")
        'ckpt/manifest.json: missing. See docs/troubleshooting.md#manifest-missing'
        >>> raise ValueError("Invalid reduction: ..." + see("invalid-reduction"))  # doctest: +SKIP
    """
    return _Link(f" See {TROUBLESHOOTING}#{anchor}")


class UnifiedError(Exception):
    """Base class of the errors raised by `unified`."""


class DistributedError(UnifiedError, RuntimeError):
    """A collective operation failed on this process (a peer raised, died or disconnected)."""


class BarrierTimeout(DistributedError, TimeoutError):
    """Some processes did not reach a collective within its timeout, or died before it.

    Attributes:
        operation: the collective that failed, e.g. ``"wait_for_everyone #17"``.
        timeout: the timeout in seconds.
        missing: process indices that did not arrive, or ``None`` when the backend cannot know.

    Example:
        >>> try:
        ...     accelerator.wait_for_everyone(timeout=30)      # doctest: +SKIP
        ... except unified.BarrierTimeout as err:
        ...     print(err.missing)                              # e.g. [1]
    """

    def __init__(
        self,
        operation: str,
        timeout: float,
        missing: Optional[Sequence[int]] = None,
        *,
        process_index: int = 0,
        num_processes: int = 1,
        detail: str = "",
    ) -> None:
        self.operation = operation
        self.timeout = timeout
        self.missing = sorted(missing) if missing is not None else None
        self.process_index = process_index
        self.num_processes = num_processes
        if self.missing:
            who = ", ".join(str(m) for m in self.missing)
            noun = "process" if len(self.missing) == 1 else "processes"
            cause = f"{noun} {who} did not arrive - it may have crashed or be stuck"
        else:
            cause = "some process did not arrive - it may have crashed or be stuck"
        message = (
            f"[process {process_index}/{num_processes}] {operation} timed out after "
            f"{timeout:g}s; {cause}. Check the other processes' logs for an earlier error"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message + see("barrier-timeout"))


class CheckpointError(UnifiedError, ValueError):
    """A checkpoint is missing, incomplete, corrupted, hostile or does not match this run."""


class BackendUnavailable(UnifiedError, ImportError):
    """The requested backend's framework is not installed."""


class RegistrationError(UnifiedError, ValueError, TypeError):
    """`register_for_checkpointing` got objects without ``state_dict`` / ``load_state_dict``."""


class MissingCapability(UnifiedError, NotImplementedError, AttributeError):
    """A call needs an optional ability the backend does not have (e.g. ``accelerator.mesh`` on a
    backend without a device mesh). Also an `AttributeError`, so ``hasattr`` returns False."""


class InvalidBackend(UnifiedError, TypeError):
    """A registered backend class does not implement the interface (a required method is missing)."""


def failure_reason(error: BaseException) -> str:
    """What other processes are told of this process's ``error``: a unified error's own message
    (it names the file or process), anything else with its type.

    Example:
        >>> failure_reason(OSError("disk full"))
        'OSError: disk full'
    """
    return str(error) if isinstance(error, UnifiedError) else f"{type(error).__name__}: {error}"
