"""Preemption as a coordinated checkpoint, and what a process tells its launcher when it ends.

Schedulers (SLURM, spot instances) announce the end of a job with a signal some seconds before
they stop it. With ``Accelerator(handle_preemption=True)`` (or ``UNIFIED_HANDLE_PREEMPTION=1``)
SIGTERM and SIGUSR1 (or the signals ``preemption_signals=`` / ``--preemption-signals`` name,
SIGUSR2 for submitit say) only raise a flag (`SignalFlag`); the next ``check_trigger`` folds it into
its collective, so the trigger fires on every process in the same call and
``accelerator.preempted`` becomes True everywhere. The script saves, and
``accelerator.exit_if_preempted()`` ends the process with `PREEMPTED_EXIT_CODE`, which a requeue
script can test.

`unified launch` gives each worker a status folder (``UNIFIED_STATUS_DIR``): a worker leaves
``preempted-<process index>`` there when it exits as preempted, and ``broken-<process index>``
when its group broke, so that the launcher can report the group's status even when the workers'
own exit codes do not reach it (torchrun summarises every failure as 1), and never reports
success for a group that broke.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..errors import see

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "HANDLE_VARIABLE", "SIGNALS_VARIABLE", "STATUS_DIR_VARIABLE",
           "SignalFlag", "resolve_handle_preemption", "resolve_preemption_signals", "signal_names", "record_status",
           "read_statuses"]

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry".
PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HANDLE_VARIABLE = "UNIFIED_HANDLE_PREEMPTION"
# The preemption signals when neither Accelerator(preemption_signals=) nor --preemption-signals
# names them: comma-separated names ("SIGTERM,SIGUSR2"); `unified launch` sets it for its workers.
SIGNALS_VARIABLE = "UNIFIED_PREEMPTION_SIGNALS"
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
STATUS_DIR_VARIABLE = "UNIFIED_STATUS_DIR"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def resolve_handle_preemption(value: Optional[bool]) -> bool:
    """``value``, else ``UNIFIED_HANDLE_PREEMPTION`` (``1``/``true``/``yes``/``on`` or
    ``0``/``false``/``no``/``off``), else False."""
    if value is not None:
        return bool(value)
    raw = os.environ.get(HANDLE_VARIABLE, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"Unknown {HANDLE_VARIABLE}={raw!r}: expected 1/true/yes/on or 0/false/no/off."
                     + see("handle-preemption-variable"))


def resolve_preemption_signals(value: Optional[Union[str, Sequence[Union[str, int]]]] = None) -> Tuple[int, ...]:
    """The signals that announce a preemption: ``value`` (names such as ``"SIGUSR2"`` or
    ``"USR2"``, numbers, or one comma-separated string), else ``UNIFIED_PREEMPTION_SIGNALS``, else
    SIGTERM and SIGUSR1. Raises `ValueError` for an unknown name or a signal no process can catch.

    Example:
        >>> resolve_preemption_signals("SIGTERM,USR2") == (signal.SIGTERM, signal.SIGUSR2)
        True
    """
    raw = value if value is not None else os.environ.get(SIGNALS_VARIABLE, "")
    parts = [p.strip() for p in raw.split(",")] if isinstance(raw, str) else list(raw)
    parts = [p for p in parts if p != ""]
    if not parts:
        return PREEMPTION_SIGNALS
    chosen = []
    for part in parts:
        try:
            if isinstance(part, int) or str(part).isdigit():
                number = signal.Signals(int(part))
            else:
                name = str(part).upper()
                number = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            raise ValueError(f"Unknown preemption signal {part!r}: expected names such as SIGTERM, SIGUSR1, SIGUSR2 "
                             "(or their numbers)." + see("preemption-signals")) from None
        if number in _UNCATCHABLE:
            raise ValueError(f"{number.name} cannot announce a preemption: no process can catch it, so there is no "
                             "time to save. Use a signal the scheduler sends before it (SIGTERM, SIGUSR1, SIGUSR2)."
                             + see("preemption-signals"))
        chosen.append(number)
    return tuple(dict.fromkeys(chosen))


def signal_names(signals: Sequence[int]) -> str:
    """``"SIGTERM,SIGUSR2"``: what `UNIFIED_PREEMPTION_SIGNALS` holds."""
    return ",".join(signal.Signals(s).name for s in signals)


class SignalFlag:
    """The process-wide record of preemption signals: a handler that only counts them.

    Signal handlers belong to the process, so one flag serves every Accelerator of it; each
    reader remembers how many signals it already consumed (`consume`).

    Example:
        >>> flag = SignalFlag.install()
        >>> seen = 0
        >>> pending, seen = flag.consume(seen)
    """

    _instance: Optional["SignalFlag"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.count = 0
        self.last_signal: Optional[int] = None
        self.signals: List[int] = []  # counted from now on

    @classmethod
    def install(cls, signals: Sequence[int] = PREEMPTION_SIGNALS) -> "SignalFlag":
        """Count ``signals`` (default SIGTERM and SIGUSR1) from now on instead of their default
        action; a later call adds its signals to those counted already. Must run in the main
        thread, where Python runs signal handlers."""
        with cls._lock:
            flag = cls._instance or cls()
            missing = [s for s in signals if s not in flag.signals]
            if missing and threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    "Accelerator(handle_preemption=True) must be created in the main thread: Python runs "
                    "signal handlers only there." + see("preemption-main-thread"))
            for sig in missing:
                signal.signal(sig, flag._handle)
                flag.signals.append(sig)
            cls._instance = flag
            return flag

    def _handle(self, signum: int, _frame: object) -> None:
        self.count += 1
        self.last_signal = signum

    def consume(self, seen: int) -> "tuple[bool, int]":
        """Whether a signal arrived since a reader saw ``seen`` of them, and the new count."""
        now = self.count
        return now > seen, now

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.last_signal).name if self.last_signal else "a signal"


# -- the status folder shared with `unified launch` -----------------------------------------------
def record_status(kind: str, process_index: int) -> None:
    """Leave ``<kind>-<process_index>`` in the launcher's status folder, when there is one.
    Never raises: the status is a courtesy to the launcher, not part of the run."""
    folder = os.environ.get(STATUS_DIR_VARIABLE)
    if not folder:
        return
    try:
        with open(os.path.join(folder, f"{kind}-{int(process_index)}"), "w"):
            pass
    except OSError:
        pass


def read_statuses(folder: str, process_indices: Sequence[int]) -> Dict[str, List[int]]:
    """Which of ``process_indices`` left which status in ``folder``: kind -> process indices."""
    found: Dict[str, List[int]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    wanted = set(process_indices)
    for name in names:
        kind, _, index = name.rpartition("-")
        if kind and index.isdigit() and int(index) in wanted:
            found.setdefault(kind, []).append(int(index))
    return {kind: sorted(indices) for kind, indices in found.items()}
