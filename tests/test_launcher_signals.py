"""The launcher ends, and leaves no process behind, however it is ended (issue 11, findings 12, 13).

Each test starts `unified launch -n 2` with `tests/scripts/linger.py`, whose workers record their
pid and their parent's pid in a folder and then sleep. The processes of the group are those
workers, their parents (torchrun) and every descendant of the launcher seen while the workers
ran (the JAX coordinator). Each test ends the launcher one way and checks, within a bound, that
none of them is alive; whatever a test started and finds alive at its end is killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import pytest

from unified.launcher.parent_watch import PARENT_VARIABLE, watched

from .conftest import BACKENDS

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]
ROOT = Path(__file__).resolve().parents[1]
LINGER = ROOT / "tests" / "scripts" / "linger.py"
STARTUP_SECONDS = 120  # torchrun or the JAX coordinator import their framework on a busy machine
GRACE_BOUND_SECONDS = 30  # the launcher's 10 s grace, with room to spare
GONE_BOUND_SECONDS = 15


def _state(pid: int) -> str:
    """The process's state letter, '' when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")  # a zombie's parent died; it runs no code


def _descendants(root: int) -> Set[int]:
    parents: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parents[int(entry)] = int(file.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: Set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _survivors(pids: Set[int], bound: float) -> Set[int]:
    deadline = time.monotonic() + bound
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


class Group:
    """One launcher started by a test and the processes it was seen to start."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.launcher: Optional[subprocess.Popen] = None
        self.pids: Set[int] = set()

    def start(self, backend: str, *script_args: str, stdout=None, grace_period: float = 1) -> subprocess.Popen:
        """Start the launcher; its output goes to ``stdout`` (default: the log file) and its
        errors to the log file. ``grace_period``: what workers get after a forwarded SIGTERM."""
        command = [sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", backend,
                   "--grace-period", str(grace_period), str(LINGER), str(self.folder), *script_args]
        with open(self.folder / "launcher.log", "wb") as log:
            self.launcher = subprocess.Popen(command, cwd=ROOT, stdout=stdout or log, stderr=log)
        return self.launcher

    def log(self) -> str:
        """The end of the launcher's log, for failure messages."""
        return (self.folder / "launcher.log").read_text(errors="replace")[-3000:]

    def wait_for_workers(self, count: int = 2) -> None:
        """Until ``count`` workers recorded themselves; then remember the group's processes."""
        deadline = time.monotonic() + STARTUP_SECONDS
        while len(self._records()) < count:
            assert self.launcher.poll() is None, f"the launcher ended early with {self.launcher.returncode}"
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        for path in self._records():
            self.pids.update(int(word) for word in path.read_text().split())
        self.pids |= _descendants(self.launcher.pid)
        self.pids.discard(self.launcher.pid)

    def _records(self) -> List[Path]:
        """The workers' complete records (``{pid}``; ``{pid}.tmp`` is one being written)."""
        return [path for path in self.folder.glob("[0-9]*") if path.suffix != ".tmp"]

    def survivors(self) -> Set[int]:
        return _survivors(self.pids, GONE_BOUND_SECONDS)

    def kill_leftovers(self) -> None:
        """SIGKILL what this test started and is still alive (the launcher first)."""
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.kill()
            self.launcher.wait()
        for pid in self.pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    started = Group(tmp_path)
    try:
        yield started
    finally:
        started.kill_leftovers()


def _exit_code(launcher: subprocess.Popen, bound: float) -> int:
    try:
        return launcher.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not end within {bound} s")


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_stdout_stops_the_group(backend, group):
    """`unified launch ... | head -2`: more output than a pipe holds, then the reader leaves."""
    launcher = group.start(backend, "--flood", "100000", stdout=subprocess.PIPE)
    first = [launcher.stdout.readline() for _ in range(2)]
    assert all(first), first
    group.wait_for_workers()
    launcher.stdout.close()
    code = _exit_code(launcher, GRACE_BOUND_SECONDS)
    assert (code, group.survivors()) == (128 + signal.SIGPIPE, set()), group.log()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sig, worker_args", [(signal.SIGHUP, ()), (signal.SIGTERM, ("--ignore-sigterm",)),
                                              (signal.SIGUSR1, ())],
                         ids=["sighup", "sigterm-to-workers-that-ignore-it",
                              "sigusr1-forwarded-to-workers-without-handler"])
def test_a_stop_signal_to_the_launcher_stops_the_group(backend, group, sig, worker_args):
    launcher = group.start(backend, *worker_args)
    group.wait_for_workers()
    launcher.send_signal(sig)
    code = _exit_code(launcher, GRACE_BOUND_SECONDS)
    assert (code, group.survivors()) == (128 + sig, set()), group.log()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_of_the_launcher_leaves_no_worker(backend, group):
    launcher = group.start(backend)
    group.wait_for_workers()
    launcher.kill()
    launcher.wait()
    assert group.survivors() == set(), group.log()


def test_parent_watch_ends_a_process_whose_parent_is_already_gone():
    """The wrapper's race guard: a parent other than the expected one means it died already."""
    check = f"import os; print(os.environ[{PARENT_VARIABLE!r}] == str(os.getpid()))"
    command = watched([sys.executable, "-c", check])
    kept = subprocess.run(command, env={**os.environ, PARENT_VARIABLE: str(os.getpid())},
                          capture_output=True, text=True, timeout=60)
    assert (kept.returncode, kept.stdout.strip()) == (0, "True"), kept.stderr
    never_a_pid = str(2 ** 22 + 1)  # above Linux's largest pid_max
    orphan = subprocess.run(command, env={**os.environ, PARENT_VARIABLE: never_a_pid}, capture_output=True, timeout=60)
    assert orphan.returncode == -signal.SIGKILL
