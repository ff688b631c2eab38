"""Run a program that dies with its parent: ``python -I parent_watch.py PROGRAM [ARGS...]``.

`unified launch` starts every child through this wrapper, and torchrun's workers too, so that
no process of a group outlives the launcher, even when the launcher is killed with SIGKILL and
can clean nothing up. The wrapper asks Linux to send the process SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``), then replaces itself with the program.
Chained, this reaches torchrun's workers: the launcher dies, torchrun gets SIGKILL, its workers
get SIGKILL.

The parent expected is the one named by ``UNIFIED_PARENT_PID``: when the process's parent is
another one, the parent died before the request took effect, and the wrapper ends the process
at once. Before ``exec`` the variable is set to this process's id, for the children it starts
through the wrapper in turn (torchrun's workers).

Elsewhere than on Linux the wrapper only runs the program. It is run as a file, in isolated
mode, and imports nothing but the standard library: it must not import `unified` (whose
modules would shadow the standard library's from this folder) nor be slow to start.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import List, Sequence

__all__ = ["PARENT_VARIABLE", "watched"]

PARENT_VARIABLE = "UNIFIED_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def watched(argv: Sequence[str]) -> List[str]:
    """The command that runs ``argv`` through this wrapper. A ``--`` stands before ``argv``: a
    launcher that parses this command's arguments (torchrun) then takes none of the script's
    flags for its own, as Python's argparse would when one abbreviates one of its options."""
    return [sys.executable, "-I", os.path.abspath(__file__), "--", *argv]


def die_with_parent() -> None:
    """Ask for SIGKILL when the parent dies; end now if the expected parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    expected = os.environ.get(PARENT_VARIABLE, "")
    if expected.isdigit() and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str]) -> None:
    """Run ``argv`` (a program and its arguments; the launcher always passes one) in this process."""
    die_with_parent()
    os.environ[PARENT_VARIABLE] = str(os.getpid())
    argv = list(argv[1:] if argv[:1] == ["--"] else argv)  # the "--" of `watched`, if the launcher kept it
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
