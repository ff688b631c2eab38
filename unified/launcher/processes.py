"""One machine's processes under the launcher: started, watched and stopped as one group.

`run_group` (and `run_group_outcome`, which also says what ended the group) runs a
`plan.LaunchPlan`'s `Worker`s: output copied line by line under each process's label, the
first failure stops every other process, Ctrl-C (or SIGHUP, SIGQUIT) stops all of them, and so
does the end of our output's reader (`unified launch ... | head`). SIGTERM and SIGUSR1, what
schedulers send before they stop a job, are forwarded to every worker, which then has
``--grace-period`` seconds to save and exit (`unified.runtime.preemption`); a second signal or
the end of the grace period stops them. No child outlives the launcher: each runs through
`parent_watch` and is killed when its parent dies. `Spares` are the next attempt's slow-starting
processes, started ahead under ``--max-restarts``.

Exit status: 0 when every worker exited with 0 and none saw its group break;
`unified.PREEMPTED_EXIT_CODE` when every worker of this machine exited as preempted
(``accelerator.exit_if_preempted()``); else the first failure's code (128 + N for a signal N),
128 + N when signal N stopped the group, 1 for a group that broke although its processes exited
with 0.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Dict, List, Optional, Sequence, Set, TextIO, Tuple

from ..errors import see
from ..runtime.preemption import PREEMPTED_EXIT_CODE, PREEMPTION_SIGNALS, STATUS_DIR_VARIABLE, read_statuses
from .parent_watch import PARENT_VARIABLE, watched

__all__ = ["Worker", "Spares", "ProcessGroup", "run_group", "run_group_outcome", "stop_processes", "RESTARTABLE"]

GRACE_SECONDS = 10.0
# After a forwarded SIGTERM/SIGUSR1 (or a worker's exit as preempted), how long the workers may
# take to save and exit before they are stopped: `--grace-period`.
GRACE_PERIOD_SECONDS = 60.0
# With several machines, machine 0 keeps services (the JAX coordinator) up this long after its
# own workers ended, so that the other machines' workers can say goodbye to it.
SERVICE_LINGER_SECONDS = 10.0
# Ended by one of these, the launcher stops its children (SIGINT forwarded as SIGINT, the others
# as SIGTERM) and exits 128 + the signal's number. torchrun handles the same set. The preemption
# signals (SIGTERM and SIGUSR1 unless --preemption-signals names others) are first forwarded to
# the workers, who get the grace period.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# The exit code when our output's reader went away: a shell reports a process killed by SIGPIPE so.
OUTPUT_CLOSED_CODE = 128 + signal.SIGPIPE


@dataclass
class Worker:
    """One child process of the launcher and how to label its output."""

    argv: List[str]
    env: Dict[str, str]
    label: Callable[[str], Optional[str]] = field(default=lambda line: line)  # None: leave the line out
    service: bool = False  # runs until the workers ended (then SIGTERM), its exit is not a result
    # starts the workers itself (torchrun): signals meant for the workers go to the processes it
    # started through `unified.launcher.parent_watch`, and its exit code only summarises theirs
    agent: bool = False
    process_index: Optional[int] = None  # the group index of a worker started directly
    # (spare command, request): a program that can be started before this worker's arguments are
    # known and then told them in one JSON line on its stdin, ``{"args": request, "env": env}``
    # (`Spares`: the next attempt's torchrun, with torch imported while this attempt runs)
    spare: Optional[Tuple[List[str], List[str]]] = None


class Spares:
    """Processes started ahead for the next attempt of `launch --max-restarts` (a `Worker`'s
    ``spare`` command): by the time a restart needs them, their slow start (torchrun importing
    torch, about 1 s) is done. `ProcessGroup.start` takes one for a worker with the same spare
    command, hands it the worker's request and environment, and copies its output; a worker with
    none is started as usual. Unused ones are killed by `close`.

    Example:
        >>> spares = Spares()
        >>> spares.prepare([worker], delay=2.0)   # while the attempt runs
        >>> spare = spares.take(worker.spare[0])  # at the restart: a started Popen, or None
        >>> spares.close()
    """

    def __init__(self) -> None:
        self._ready: Dict[Tuple[str, ...], subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._timers: List[threading.Timer] = []
        self._closed = False

    def prepare(self, workers: Sequence[Worker], delay: float) -> None:
        """Start a spare for each worker that has a spare command, after ``delay`` seconds (the
        attempt's own start-up goes first)."""
        commands = [tuple(w.spare[0]) for w in workers if w.spare is not None]
        if not commands:
            return

        def start() -> None:
            for command in commands:
                with self._lock:
                    if self._closed or command in self._ready and self._ready[command].poll() is None:
                        continue
                    self._ready[command] = subprocess.Popen(
                        watched(list(command)), env={**os.environ, PARENT_VARIABLE: str(os.getpid())},
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

        timer = threading.Timer(delay, start)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def take(self, command: Sequence[str]) -> Optional[subprocess.Popen]:
        with self._lock:
            spare = self._ready.pop(tuple(command), None)
        return spare if spare is not None and spare.poll() is None else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left, self._ready = list(self._ready.values()), {}
        for timer in self._timers:
            timer.cancel()
        for spare in left:
            if spare.poll() is None:
                _signal_groups({spare.pid}, signal.SIGKILL)
            spare.wait()


class _Output:
    """Our stdout, shared by the pumps. When its reader is gone (``| head``), what follows is
    discarded: the pumps go on draining the children's pipes, so that no child blocks on a full
    pipe, and `run_group` stops the group."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def write(self, text: str) -> None:
        with self.lock:
            if self.closed.is_set():
                return
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except OSError:  # BrokenPipeError; EIO once a terminal is gone
                _discard(sys.stdout)
                self.closed.set()


def _discard(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null, so that what is still buffered, and the
    interpreter's flush at exit, cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def note(message: str) -> None:
    """Write ``message`` to stderr, which may be the closed pipe too (``2>&1 | head``)."""
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except OSError:
        _discard(sys.stderr)


def _pump(stream: IO[bytes], label: Callable[[str], Optional[str]], output: _Output) -> None:
    """Copy a child's output, line by line and labelled, until the child closes it; a fragment
    whose label is ``None`` is left out (an agent's noise, `Worker.label`)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        # progress bars redraw with "\r": label every redrawn fragment, not only the first
        parts = [label(part) if part else part for part in line.split("\r")]
        if any(part is not None for part in parts):
            output.write("\r".join(part for part in parts if part is not None) + "\n")
    stream.close()


def _parents() -> Dict[int, int]:
    """Every process's parent, from /proc (empty where there is none)."""
    parents: Dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parents
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                # the command name, in parentheses, may hold spaces and parentheses itself
                parents[int(entry)] = int(file.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _descendants(roots: Set[int]) -> Set[int]:
    """The processes below ``roots`` (children, their children, ...), not ``roots`` themselves."""
    parents = _parents()
    found: Set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _groups(pids: Set[int]) -> Set[int]:
    """The process groups of ``pids`` (those still alive), never the launcher's own."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    return groups - {os.getpgrp()}


def _signal_groups(groups: Set[int], sig: int) -> None:
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_processes(procs: Sequence[subprocess.Popen], first: int = signal.SIGTERM) -> None:
    """Send ``first`` to the process group of every running child, wait up to `GRACE_SECONDS`,
    then SIGKILL those groups and the groups of everything the children started: torchrun puts
    each worker in a session of its own, out of reach of a signal to torchrun's group."""
    running = [p for p in procs if p.poll() is None]
    _signal_groups({p.pid for p in running}, first)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.05)
    # The group of a child that ended in the grace period may still hold processes it started;
    # while it holds any, its number cannot be given to another process, so signalling it is safe.
    stuck = {p.pid for p in running if p.poll() is None}
    _signal_groups({p.pid for p in running} | _groups(_descendants(stuck)), signal.SIGKILL)
    for proc in procs:
        proc.wait()


class ProcessGroup:
    """Children started as one group, and stopped as one: the process runner that `unified
    launch` (`run_group`) and the conformance suite (`unified.testing.harness`) share.

    Each child runs through `unified.launcher.parent_watch` (it dies with us, even when we are SIGKILLed)
    in a session of its own (a signal meant for it reaches what it started). Its output is
    either copied line by line, labelled, into ``output`` (the launcher) or written to a file of
    ``logs`` (the suite: one file per child). ``status_dir``, when given, is where the workers
    report being preempted or seeing the group break (`unified.runtime.preemption`).

    Example:
        >>> group = ProcessGroup([Worker([sys.executable, "-c", "pass"], dict(os.environ))],
        ...                      logs=[os.devnull]).start()
        >>> group.wait()
        [0]
    """

    def __init__(self, workers: Sequence[Worker], *, output: Optional["_Output"] = None,
                 logs: Optional[Sequence[str]] = None, status_dir: Optional[str] = None,
                 cwd: Optional[str] = None, spares: Optional[Spares] = None) -> None:
        assert (output is None) != (logs is None), "a group's output goes either to our stdout or to files"
        self.workers, self.output, self.logs, self.spares = list(workers), output, logs, spares
        self.status_dir, self.cwd = status_dir, cwd
        self.procs: List[subprocess.Popen] = []
        self.pumps: List[threading.Thread] = []
        self.exit_times: List[Optional[float]] = []  # wall-clock time each child was seen ended

    def start(self) -> "ProcessGroup":
        for i, worker in enumerate(self.workers):
            env = {**worker.env, PARENT_VARIABLE: str(os.getpid())}
            if self.status_dir is not None and not worker.service:
                env[STATUS_DIR_VARIABLE] = self.status_dir
            spare = self.spares.take(worker.spare[0]) if self.spares and worker.spare and self.logs is None else None
            if spare is not None and self._hand_over(spare, worker, env):
                proc = spare
            elif self.logs is not None:
                with open(self.logs[i], "wb") as log:  # the child keeps its own descriptor
                    proc = subprocess.Popen(watched(worker.argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.cwd)
            else:
                proc = subprocess.Popen(watched(worker.argv), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, cwd=self.cwd)
            if self.logs is None:
                pump = threading.Thread(target=_pump, args=(proc.stdout, worker.label, self.output), daemon=True)
                pump.start()
                self.pumps.append(pump)
            self.procs.append(proc)
            self.exit_times.append(None)
        return self

    def _hand_over(self, spare: subprocess.Popen, worker: Worker, env: Dict[str, str]) -> bool:
        """Tell a spare what to run (False, and the spare killed, when it cannot be told)."""
        assert worker.spare is not None and spare.stdin is not None
        try:
            spare.stdin.write((json.dumps({"args": worker.spare[1], "env": env}) + "\n").encode())
            spare.stdin.close()
            return True
        except OSError:  # it ended meanwhile
            _signal_groups({spare.pid}, signal.SIGKILL)
            spare.wait()
            return False

    def poll(self) -> List[Optional[int]]:
        """Every child's exit code (``None``: running), noting when each was first seen ended."""
        codes = [proc.poll() for proc in self.procs]
        for i, code in enumerate(codes):
            if code is not None and self.exit_times[i] is None:
                self.exit_times[i] = time.time()
        return codes

    def kill(self, only: Optional[Sequence[subprocess.Popen]] = None) -> None:
        """SIGKILL the session of every running child (or of ``only`` those) at once."""
        _signal_groups({p.pid for p in (self.procs if only is None else only) if p.poll() is None}, signal.SIGKILL)

    def stop(self, first: int = signal.SIGTERM, only: Optional[Sequence[subprocess.Popen]] = None) -> None:
        """Stop the children (or ``only`` those) with `stop_processes`'s escalation."""
        stop_processes(self.procs if only is None else only, first)

    def wait(self, deadline: Optional[float] = None, poll_interval: float = 0.02) -> List[Optional[int]]:
        """Wait until every child ended or ``deadline`` (monotonic seconds) passed; the codes."""
        while True:
            codes = self.poll()
            if all(code is not None for code in codes) or (deadline is not None and time.monotonic() >= deadline):
                return codes
            time.sleep(poll_interval)

    def join_output(self, timeout: float = 5.0) -> None:
        """Wait for the pumps to copy what the children wrote last."""
        for pump in self.pumps:
            pump.join(timeout=timeout)


def _wrapped_children(agent: int) -> Set[int]:
    """The processes ``agent`` started through `unified.launcher.parent_watch` (torchrun's workers): the
    wrapper leaves each one's own pid in its environment."""
    found = set()
    for pid, parent in _parents().items():
        if parent != agent:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                variables = file.read().split(b"\0")
        except OSError:
            continue
        if f"{PARENT_VARIABLE}={pid}".encode() in variables:
            found.add(pid)
    return found


def _forward(procs: Sequence[subprocess.Popen], workers: Sequence[Worker], sig: int, done: Set[int]) -> None:
    """Send ``sig`` to every worker process not in ``done`` (never to services or agents), and
    add them to ``done``."""
    for proc, worker in zip(procs, workers):
        if worker.service or proc.poll() is not None:
            continue
        for pid in (_wrapped_children(proc.pid) if worker.agent else {proc.pid}) - done:
            try:
                os.kill(pid, sig)
                done.add(pid)
            except (ProcessLookupError, PermissionError):
                pass


def run_group(workers: Sequence[Worker], remote_peers: bool = False, grace_period: float = GRACE_PERIOD_SECONDS,
              process_indices: Sequence[int] = ()) -> int:
    """Run the workers to completion; the first failure stops the rest. Returns the exit code.

    ``process_indices``: the group indices of this machine's workers, whose statuses (preempted,
    broken; see `unified.runtime.preemption`) decide the exit code with their exit codes.
    """
    return run_group_outcome(workers, remote_peers, grace_period, process_indices)[0]


# What ended a group (`run_group_outcome`); only the last three may be restarted (`--max-restarts`).
FINISHED, OUTPUT_CLOSED, PREEMPTED, INTERRUPTED, FAILED, BROKE, ENDED_ELSEWHERE = (
    "finished", "output closed", "preempted", "stopped by a signal", "a process failed", "the group broke",
    "the attempt ended on another machine")
RESTARTABLE = (FAILED, BROKE, ENDED_ELSEWHERE)


def run_group_outcome(workers: Sequence[Worker], remote_peers: bool = False,
                      grace_period: float = GRACE_PERIOD_SECONDS, process_indices: Sequence[int] = (),
                      preemption_signals: Sequence[int] = PREEMPTION_SIGNALS,
                      remote_stop: Optional[Callable[[], Optional[str]]] = None,
                      spares: Optional[Spares] = None) -> Tuple[int, str]:
    """`run_group`, and what ended the group: one of `FINISHED`, `OUTPUT_CLOSED`, `PREEMPTED`,
    `INTERRUPTED`, `FAILED`, `BROKE`, `ENDED_ELSEWHERE`. ``preemption_signals`` are forwarded to
    the workers, who get the grace period; the other handled signals stop them. ``remote_stop``,
    polled, says why the group must stop now (its attempt ended on another machine), else ``None``.
    ``spares``: processes started ahead that workers with a spare command take over."""
    output = _Output()
    interrupted: List[int] = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    status_dir = tempfile.mkdtemp(prefix="unified-launch-")
    previous = {s: signal.signal(s, on_signal) for s in dict.fromkeys(STOP_SIGNALS + tuple(preemption_signals))}
    children = ProcessGroup(workers, output=output, status_dir=status_dir, spares=spares)
    try:
        children.start()
        group = _Group(children.procs, workers, output, interrupted, remote_peers, grace_period, status_dir,
                       process_indices, tuple(preemption_signals), remote_stop)
        code = group.supervise()
    except BaseException:
        children.stop()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(status_dir, ignore_errors=True)
    children.join_output()
    if group.stopped_for:
        note(f"unified launch: {group.stopped_for}; stopped this machine's processes.")
        return code, ENDED_ELSEWHERE
    if code == OUTPUT_CLOSED_CODE and output.closed.is_set():
        note("unified launch: the output was closed (its reader ended); stopped the processes."
             f"{see('launch-output-closed')}")
        return code, OUTPUT_CLOSED
    if code == PREEMPTED_EXIT_CODE and group.preempted:
        note(f"unified launch: every process exited as preempted (exit code {PREEMPTED_EXIT_CODE}); "
              f"resume with load_state().{see('launch-preempted')}")
        return code, PREEMPTED
    if code and group.broken_quietly:
        note(f"unified launch: the process group broke (every process here exited with 0, but process(es) "
              f"{', '.join(map(str, group.broken))} reported the break); exit code {code}.{see('launch-group-broke')}")
        return code, BROKE
    if code and interrupted:
        return code, INTERRUPTED
    if code:
        note(f"unified launch: a process failed (exit code {code}); stopped the others.{see('launch-process-failed')}")
        return code, PREEMPTED if code == PREEMPTED_EXIT_CODE else FAILED
    return code, FINISHED


class _Group:
    """The supervision of one launched group: polls the children until the group is done, stops
    them all, and decides the exit code."""

    def __init__(self, procs: Sequence[subprocess.Popen], workers: Sequence[Worker], output: _Output,
                 interrupted: List[int], remote_peers: bool, grace_period: float, status_dir: str,
                 process_indices: Sequence[int], preemption_signals: Tuple[int, ...] = PREEMPTION_SIGNALS,
                 remote_stop: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.procs, self.workers, self.output, self.interrupted = procs, workers, output, interrupted
        self.remote_stop = remote_stop
        self.stopped_for: Optional[str] = None
        self.preemption_signals = preemption_signals
        self.remote_peers, self.grace_period = remote_peers, grace_period
        self.status_dir, self.indices = status_dir, list(process_indices)
        self.mains = [(p, w) for p, w in zip(procs, workers) if not w.service]
        self.preempted = False
        self.broken: List[int] = []
        self.broken_quietly = False

    def _statuses(self) -> Dict[str, List[int]]:
        return read_statuses(self.status_dir, self.indices)

    def supervise(self) -> int:
        forwarded_to: Set[int] = set()
        grace_until: Optional[float] = None   # workers are saving: wait for them until then
        next_forward = 0.0
        while True:
            now = time.monotonic()
            if self.interrupted:
                first = self.interrupted[0]
                if first not in self.preemption_signals or len(self.interrupted) > 1 or self.grace_period <= 0:
                    stop_processes(self.procs, signal.SIGINT if first == signal.SIGINT else signal.SIGTERM)
                    return 128 + first
                if grace_until is None:
                    grace_until = now + self.grace_period
                if now >= next_forward:  # workers an agent starts late get it too
                    if not forwarded_to:
                        note(f"unified launch: received {signal.Signals(first).name}; forwarded it to every process, "
                              f"which has {self.grace_period:g}s to save and exit (a second signal stops them now).")
                    _forward(self.procs, self.workers, first, forwarded_to)
                    next_forward = now + 1.0
                if now >= grace_until:
                    note(f"unified launch: the processes did not exit within the {self.grace_period:g}s grace period; "
                          f"stopping them.{see('launch-grace-period-over')}")
                    stop_processes(self.procs)
                    return 128 + first
            if self.output.closed.is_set():
                stop_processes(self.procs)
                return OUTPUT_CLOSED_CODE
            if grace_until is None and self.remote_stop and self.remote_stop():
                self.stopped_for = self.remote_stop()
                stop_processes(self.procs)
                return 1
            codes = [p.poll() for p, _ in self.mains]
            failed = [c for c in codes if c not in (None, 0)]
            failed += [p.returncode or 1 for p, w in zip(self.procs, self.workers)
                       if w.service and p.poll() is not None]
            if failed and all(c is not None for c in codes) or all(c == 0 for c in codes):
                break
            if failed:
                # a worker that exited as preempted: the others are saving too, give them the grace
                if grace_until is None and (PREEMPTED_EXIT_CODE in failed or "preempted" in self._statuses()):
                    grace_until = now + self.grace_period
                if grace_until is None or now >= grace_until:
                    break
            time.sleep(0.05)
        if all(c == 0 for c in codes):
            time.sleep(SERVICE_LINGER_SECONDS if len(self.mains) < len(self.procs) and self.remote_peers else 0)
        stop_processes(self.procs)
        return self._code([p.returncode for p, _ in self.mains], failed)

    def _code(self, codes: List[int], failed: List[Optional[int]]) -> int:
        statuses = self._statuses()
        self.broken = statuses.get("broken", [])
        if self.indices and statuses.get("preempted") == sorted(self.indices) and all(
                c == PREEMPTED_EXIT_CODE or w.agent for c, (_, w) in zip(codes, self.mains)):
            self.preempted = True
            return PREEMPTED_EXIT_CODE
        if self.interrupted:  # forwarded, and the group ended within the grace period
            return 0 if all(c == 0 for c in codes) and not self.broken else 128 + self.interrupted[0]
        failed = [c for c in failed if c is not None]
        if failed:
            others = [c for c in failed if c != PREEMPTED_EXIT_CODE] or [1]
            return others[0] if others[0] > 0 else 128 - others[0]
        if self.broken:  # every process here exited with 0, yet the group broke
            self.broken_quietly = True
            return 1
        return 0
