"""`unified launch`: start N processes of a script as one process group of a backend.

Each backend names a `Launcher` in its spec. The default one starts the backend's rendezvous
service (if it has one) on machine 0 and N workers per machine, each told its place by a
`unified.environment.ProcessEnvironment`; a backend may start its workers otherwise (torch:
through torchrun). Every path shares `run_group`: output prefixed with the process index, the
first failure stops every other process, Ctrl-C (or SIGHUP, SIGQUIT) stops all of them, and so
does the end of our output's reader (`unified launch ... | head`). SIGTERM and SIGUSR1, what
schedulers send before they stop a job, are forwarded to every worker, which then has
``--grace-period`` seconds to save and exit (`unified.preemption`); a second signal or the end of
the grace period stops them. No child outlives the launcher: each runs through
`unified.parent_watch` and is killed when its parent dies.

Exit status: 0 when every worker exited with 0 and none saw its group break;
`unified.PREEMPTED_EXIT_CODE` when every worker of this machine exited as preempted
(``accelerator.exit_if_preempted()``); else the first failure's code (128 + N for a signal N),
128 + N when signal N stopped the group, 1 for a group that broke although its processes exited
with 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Dict, List, Optional, Sequence, Set, TextIO, Tuple

from .job_secret import SECRET_VARIABLE, job_key
from .environment import BACKEND_VARIABLE, LAUNCHER_BACKEND_VARIABLE, RESTART_VARIABLE, RUN_VARIABLE, ProcessEnvironment, run_identity
from .errors import see
from .logging import PROGRESS_INTERVAL
from .parent_watch import PARENT_VARIABLE, watched
from .preemption import (PREEMPTED_EXIT_CODE, PREEMPTION_SIGNALS, SIGNALS_VARIABLE, STATUS_DIR_VARIABLE, read_statuses,
                         resolve_preemption_signals, signal_names)
from . import rendezvous as together
from .rendezvous import (BEAT_S, HEARTBEAT_TIMEOUT_S, MIN_HEARTBEAT_TIMEOUT_S, Layout, Rendezvous, RendezvousClient,
                         RendezvousLost, RendezvousServer, free_port_everywhere)
from .registry import backend_names, backend_spec, load_object, resolve_backend_name
from .training_loop import PRECISION_VARIABLE, PRECISIONS

__all__ = ["build_parser", "parse_launch_args", "launch", "main", "Launcher", "LaunchPlan", "ProcessGroup", "Worker", "run_group", "stop_processes"]

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
# --max-restarts: the next attempt's spares start this long after an attempt (its own start-up first)
SPARE_DELAY_S = 3.0
# `unified launch --verbose`: a backend's launcher (torchrun) shows its own output unfiltered
VERBOSE_VARIABLE = "UNIFIED_LAUNCH_VERBOSE"
# Workers write into pipes, whose lines we copy: tqdm bars (plain tqdm too, through its own
# variables) refresh at most every PROGRESS_INTERVAL seconds instead of every 0.1 s. A variable
# already set in our environment wins.
PROGRESS_ENV = {"TQDM_MININTERVAL": f"{PROGRESS_INTERVAL:g}", "TQDM_MAXINTERVAL": f"{PROGRESS_INTERVAL:g}"}


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="unified launch", allow_abbrev=False)
    parser.add_argument("-n", "--num-processes", "--num_processes", type=int, default=1,
                        help="processes per machine (default 1)")
    parser.add_argument("--backend", choices=backend_names(), default=None,
                        help="backend of the group (default: UNIFIED_BACKEND, else the installed one, else torch)")
    parser.add_argument("--main-process-port", "--main_process_port", type=int, default=None,
                        help="port of the rendezvous/coordinator (default: a free port on one machine, 29500 on several)")
    parser.add_argument("--num-machines", "--num_machines", "--nnodes", type=_machine_range, default=(1, 1),
                        metavar="N|MIN:MAX",
                        help="machines of the group (default 1); MIN:MAX with --max-restarts: a restart goes on "
                             "with the machines still there, at least MIN (torchrun's --nnodes)")
    parser.add_argument("--machine-rank", "--machine_rank", type=int, default=0)
    parser.add_argument("--main-process-ip", "--main_process_ip", default="127.0.0.1",
                        help="address of machine 0 (default 127.0.0.1)")
    parser.add_argument("--mixed-precision", "--mixed_precision", choices=PRECISIONS, default=None,
                        help="Accelerator(mixed_precision=...) of every process that does not pass it "
                             f"(sets {PRECISION_VARIABLE})")
    parser.add_argument("--grace-period", "--grace_period", type=float, default=GRACE_PERIOD_SECONDS,
                        help="seconds the workers get to save and exit after a SIGTERM/SIGUSR1 forwarded to them "
                             f"(default {GRACE_PERIOD_SECONDS:g}); then, or at a second signal, they are stopped")
    parser.add_argument("--preemption-signals", "--preemption_signals", default=None, metavar="SIGNALS",
                        help="comma-separated signals that announce a preemption, forwarded to the workers with the "
                             "grace period and counted by Accelerator(handle_preemption=True) (sets "
                             f"{SIGNALS_VARIABLE}; default SIGTERM,SIGUSR1; e.g. SIGTERM,SIGUSR2 for submitit)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                        help="when a process fails or the group breaks, stop what is left and start the group "
                             "again, at most this many times (default 0; one machine). The script resumes with "
                             "load_state(if_exists=True); accelerator.restart_count says which attempt it is. "
                             "A preemption (exit status 75) and a stop signal are never restarted")
    parser.add_argument("--rendezvous-timeout", "--rendezvous_timeout", type=float, default=600.0,
                        help="several machines with --max-restarts: how long an attempt waits for MIN machines "
                             "before the job gives up (default 600 s)")
    parser.add_argument("--rendezvous-last-call", "--rendezvous_last_call", type=float, default=30.0,
                        help="MIN:MAX machines: once MIN joined, how long an attempt waits for more (default 30 s; "
                             "a restart starts as soon as the machines of the last attempt still there are back)")
    parser.add_argument("--rendezvous-heartbeat-timeout", "--rendezvous_heartbeat_timeout", type=float,
                        default=HEARTBEAT_TIMEOUT_S,
                        help="several machines with --max-restarts: a machine whose launcher has not answered for "
                             f"this long is lost (default {HEARTBEAT_TIMEOUT_S:g} s, torchrun's 3 missed keep-alives "
                             f"of 5 s; at least {MIN_HEARTBEAT_TIMEOUT_S:g}): the attempt ends everywhere, and the "
                             "others stop after as long without machine 0")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show what the backend's own launcher says (torchrun's banner, agent log and "
                             f"failure report); sets {VERBOSE_VARIABLE}=1")
    parser.add_argument("--rendezvous-bind-ip", "--rendezvous_bind_ip", default=None, metavar="ADDRESS",
                        help="several machines with --max-restarts: the address of machine 0 its rendezvous listens "
                             "on (default --main-process-ip; 0.0.0.0 listens on every interface). Requests must be "
                             f"signed with {SECRET_VARIABLE}, the same on every machine (docs/security.md)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments for the script: everything after its path is the script's, never the launcher's")
    return parser


def parse_launch_args(argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Parse ``unified launch``'s command line: the launcher's options are what comes before the
    script's path (a ``--`` may end them); everything after the path is the script's, passed on as
    it is, even a flag that looks like, or abbreviates, one of the launcher's (as with ``python
    train.py ...`` and torchrun). Abbreviations of the launcher's own options are not accepted
    (``allow_abbrev=False``, as ``accelerate launch``).

    Example:
        >>> parse_launch_args(["-n", "2", "train.py", "--preempt", "-n", "5"]).script_args
        ['--preempt', '-n', '5']
    """
    parser = parser or build_parser()
    parser.allow_abbrev = False
    takes_value = {option: action.nargs != 0 for action in parser._actions for option in action.option_strings}
    at = 0
    while at < len(argv):
        arg = argv[at]
        if arg == "--":
            return _with_script_args(parser, [*argv[:at], *argv[at + 1:at + 2]], argv[at + 2:])
        if not arg.startswith("-") or arg == "-":
            break
        at += 2 if takes_value.get(arg, False) else 1  # "--opt=value", "-n2" and unknown flags are one word
    return _with_script_args(parser, list(argv[:at + 1]), argv[at + 1:])


def _with_script_args(parser: argparse.ArgumentParser, launcher_part: List[str], script_args: Sequence[str]
                      ) -> argparse.Namespace:
    args = parser.parse_args(launcher_part)
    args.script_args = list(script_args)
    return args


@dataclass
class Worker:
    """One child process of the launcher and how to label its output."""

    argv: List[str]
    env: Dict[str, str]
    label: Callable[[str], Optional[str]] = field(default=lambda line: line)  # None: leave the line out
    service: bool = False  # runs until the workers ended (then SIGTERM), its exit is not a result
    # starts the workers itself (torchrun): signals meant for the workers go to the processes it
    # started through `unified.parent_watch`, and its exit code only summarises theirs
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


def _machine_range(value: str) -> Tuple[int, int]:
    """``"4"`` -> (4, 4); ``"2:4"`` -> (2, 4)."""
    low, _, high = str(value).partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX machines, e.g. 4 or 2:4; received {value!r}."
                                         + see("launch-machine-range")) from None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _refuse_port_in_use(port: int) -> None:
    """Machine 0 listens on the main port (torch's store, JAX's coordinator); a port some other
    program listens on would fail deep inside the backend, so say it here."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is usable
        try:
            sock.bind(("", port))
        except OSError as err:
            raise SystemExit(f"unified launch: port {port} on this machine is in use ({err.strerror}); pass another "
                             f"--main-process-port, the same on every machine." + see("launch-port-in-use")) from None


def _validate(args: argparse.Namespace) -> None:
    if args.num_processes < 1:
        raise SystemExit(f"unified launch: --num-processes must be >= 1; received {args.num_processes}." + see("launch-num-processes"))
    if not 1 <= args.min_machines <= args.num_machines:
        raise SystemExit(f"unified launch: --num-machines MIN:MAX needs 1 <= MIN <= MAX; received "
                         f"{args.min_machines}:{args.num_machines}." + see("launch-machine-range"))
    if args.min_machines < args.num_machines and not getattr(args, "max_restarts", 0):
        raise SystemExit(f"unified launch: --num-machines {args.min_machines}:{args.num_machines} changes the "
                         f"machines at a restart; pass --max-restarts too." + see("launch-machine-range"))
    if not 0 <= args.machine_rank < args.num_machines:
        raise SystemExit(
            f"unified launch: expected 0 <= --machine-rank < --num-machines; received "
            f"--machine-rank {args.machine_rank} with --num-machines {args.num_machines}." + see("launch-machine-rank")
        )
    if not args.grace_period >= 0:
        raise SystemExit(f"unified launch: --grace-period must be >= 0 seconds; received {args.grace_period}."
                         + see("launch-grace-period"))
    if getattr(args, "max_restarts", 0) < 0:
        raise SystemExit(f"unified launch: --max-restarts must be >= 0; received {args.max_restarts}." + see("launch-max-restarts"))
    heartbeat = getattr(args, "rendezvous_heartbeat_timeout", HEARTBEAT_TIMEOUT_S)
    if not heartbeat >= MIN_HEARTBEAT_TIMEOUT_S:
        raise SystemExit(f"unified launch: --rendezvous-heartbeat-timeout must be at least {MIN_HEARTBEAT_TIMEOUT_S:g} "
                         f"seconds (launchers answer every {BEAT_S:g} s); received {heartbeat}."
                         + see("launch-heartbeat-timeout"))
    if not os.path.exists(args.script):
        raise SystemExit(f"unified launch: script not found: {args.script!r}." + see("launch-script-not-found"))
    try:
        resolve_preemption_signals(getattr(args, "preemption_signals", None))
    except ValueError as err:
        reason = str(err).split(" See docs/")[0]
        raise SystemExit(f"unified launch: --preemption-signals: {reason}" + see("preemption-signals")) from None


@dataclass(frozen=True)
class LaunchPlan:
    """What `unified launch` was asked to start on this machine."""

    backend: str
    num_processes: int           # per machine
    num_machines: int
    machine_rank: int
    main_process_ip: str
    port: int
    command: List[str]           # the script and its arguments
    # processes of every machine, when they differ (the test suite's 2 + 1 layout); else
    # ``num_processes`` on each. ``num_processes`` is then this machine's entry.
    machine_sizes: Tuple[int, ...] = ()

    @property
    def address(self) -> str:
        return f"{self.main_process_ip}:{self.port}"

    @property
    def total(self) -> int:
        """Processes in the whole group."""
        return sum(self.machine_sizes) if self.machine_sizes else self.num_processes * self.num_machines

    @property
    def first_index(self) -> int:
        """The group index of this machine's first process."""
        if self.machine_sizes:
            return sum(self.machine_sizes[: self.machine_rank])
        return self.machine_rank * self.num_processes

    def base_env(self) -> Dict[str, str]:
        """This environment plus the chosen backend, unbuffered output, sparse progress bars."""
        return {**PROGRESS_ENV, **os.environ, LAUNCHER_BACKEND_VARIABLE: self.backend, BACKEND_VARIABLE: self.backend,
                "PYTHONUNBUFFERED": "1"}

    def processes(self, hosted: bool) -> List[ProcessEnvironment]:
        """This machine's processes; ``hosted``: the launcher runs the rendezvous service."""
        return [ProcessEnvironment(self.first_index + local, self.total, local, self.num_processes,
                                   coordinator=self.address, service_hosted=hosted)
                for local in range(self.num_processes)]


class Launcher:
    """How a group of one backend is started (a backend's spec names an instance).

    The default: machine 0 runs `service_argv` (the rendezvous service, when there is one) in a
    child of its own, and every machine starts its workers with `process_env`
    (`direct_workers`). Override `workers` to start them another way (torch uses torchrun's
    agent); `direct_workers` stays what the group's processes are when nothing sits between them
    and the launcher (the conformance suite starts its groups so, to see each process's exit).
    """

    def process_env(self, process: ProcessEnvironment) -> Dict[str, str]:
        """The variables that make a worker join its group as ``process``."""
        return process.to_env()

    def service_argv(self, address: str, num_processes: int) -> Optional[List[str]]:
        """The command of the rendezvous service run beside the workers, or ``None``."""
        return None

    def workers(self, plan: LaunchPlan) -> List[Worker]:
        """This machine's children for `unified launch` (default: `direct_workers`)."""
        return self.direct_workers(plan)

    def direct_workers(self, plan: LaunchPlan) -> List[Worker]:
        """This machine's children started directly: the service (machine 0) and the workers."""
        service = self.service_argv(plan.address, plan.total)
        workers = []
        if plan.machine_rank == 0 and service:
            name = service[2].rsplit(".", 1)[-1] if len(service) > 2 and service[1] == "-m" else "service"
            workers.append(Worker(service, {**plan.base_env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
                                  lambda line: f"[{name}] {line}", service=True))
        for process in plan.processes(hosted=bool(service)):
            workers.append(Worker([sys.executable, *plan.command], {**plan.base_env(), **self.process_env(process)},
                                  lambda line, i=process.process_index: f"[{i}] {line}",
                                  process_index=process.process_index))
        return workers


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


def _note(message: str) -> None:
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

    Each child runs through `unified.parent_watch` (it dies with us, even when we are SIGKILLed)
    in a session of its own (a signal meant for it reaches what it started). Its output is
    either copied line by line, labelled, into ``output`` (the launcher) or written to a file of
    ``logs`` (the suite: one file per child). ``status_dir``, when given, is where the workers
    report being preempted or seeing the group break (`unified.preemption`).

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
    """The processes ``agent`` started through `unified.parent_watch` (torchrun's workers): the
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
    broken; see `unified.preemption`) decide the exit code with their exit codes.
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
        _note(f"unified launch: {group.stopped_for}; stopped this machine's processes.")
        return code, ENDED_ELSEWHERE
    if code == OUTPUT_CLOSED_CODE and output.closed.is_set():
        _note(f"unified launch: the output was closed (its reader ended); stopped the processes.{see('launch-output-closed')}")
        return code, OUTPUT_CLOSED
    if code == PREEMPTED_EXIT_CODE and group.preempted:
        _note(f"unified launch: every process exited as preempted (exit code {PREEMPTED_EXIT_CODE}); "
              f"resume with load_state().{see('launch-preempted')}")
        return code, PREEMPTED
    if code and group.broken_quietly:
        _note(f"unified launch: the process group broke (every process here exited with 0, but process(es) "
              f"{', '.join(map(str, group.broken))} reported the break); exit code {code}.{see('launch-group-broke')}")
        return code, BROKE
    if code and interrupted:
        return code, INTERRUPTED
    if code:
        _note(f"unified launch: a process failed (exit code {code}); stopped the others.{see('launch-process-failed')}")
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
                        _note(f"unified launch: received {signal.Signals(first).name}; forwarded it to every process, "
                              f"which has {self.grace_period:g}s to save and exit (a second signal stops them now).")
                    _forward(self.procs, self.workers, first, forwarded_to)
                    next_forward = now + 1.0
                if now >= grace_until:
                    _note(f"unified launch: the processes did not exit within the {self.grace_period:g}s grace period; "
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
            failed += [p.returncode or 1 for p, w in zip(self.procs, self.workers) if w.service and p.poll() is not None]
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


def launch(args: argparse.Namespace) -> int:
    """Start the group described by parsed ``args``; returns the exit code."""
    machines = args.num_machines
    args.min_machines, args.num_machines = (machines, machines) if isinstance(machines, int) else _machine_range(
        ":".join(map(str, machines)) if isinstance(machines, tuple) else machines)
    _validate(args)
    if getattr(args, "mixed_precision", None):
        os.environ[PRECISION_VARIABLE] = args.mixed_precision  # the workers inherit it
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_VARIABLE] = "1"
    preemption_signals = resolve_preemption_signals(getattr(args, "preemption_signals", None))  # checked by _validate
    if getattr(args, "preemption_signals", None):
        os.environ[SIGNALS_VARIABLE] = signal_names(preemption_signals)  # the workers' Accelerators count the same
    backend = resolve_backend_name(args.backend)
    launcher: Launcher = load_object(backend_spec(backend).launcher)
    max_restarts = getattr(args, "max_restarts", 0)
    # one identity for every attempt: a restarted job takes over its own lease on a store (checkpoint.lease)
    os.environ.setdefault(RUN_VARIABLE, run_identity())  # SLURM's job and step when there: a requeue is the same job
    options = dict(grace_period=getattr(args, "grace_period", GRACE_PERIOD_SECONDS),
                   preemption_signals=preemption_signals)
    if args.num_machines > 1 and max_restarts:
        return _launch_together(args, backend, launcher, options)
    spares = Spares() if max_restarts else None
    try:
        return _launch_alone(args, backend, launcher, options, max_restarts, spares)
    finally:
        if spares is not None:
            spares.close()


def _launch_alone(args: argparse.Namespace, backend: str, launcher: Launcher, options: dict, max_restarts: int,
                  spares: Optional[Spares]) -> int:
    """One machine (or several without restarts): attempts one after the other, each restart's
    workers taken from the spares started during the attempt before."""
    attempt = 0
    while True:
        port = args.main_process_port
        if port is None:  # a fresh port for every attempt: the last one's may linger in TIME_WAIT
            port = free_port() if args.num_machines == 1 else 29500
        if args.machine_rank == 0:
            _refuse_port_in_use(port)
        plan = LaunchPlan(backend, args.num_processes, args.num_machines, args.machine_rank, args.main_process_ip,
                          port, [args.script, *args.script_args])
        os.environ[RESTART_VARIABLE] = str(attempt)  # the workers inherit it: accelerator.restart_count
        started = time.monotonic()
        code, outcome = _run_plan(plan, launcher, options, spares=spares, prepare_next=attempt < max_restarts)
        if outcome not in RESTARTABLE or not max_restarts:
            return code
        took = time.monotonic() - started
        if attempt == max_restarts:
            _note(f"unified launch: attempt {attempt + 1} ended too ({outcome}, exit code {code}, after {took:.1f}s); "
                  f"gave up after {max_restarts} restart(s).{see('launch-gave-up')}")
            return code
        attempt += 1
        _note(f"unified launch: restart {attempt} of {max_restarts}: attempt {attempt} ended after {took:.1f}s "
              f"({outcome}, exit code {code}); starting the group again.")


def _run_plan(plan: LaunchPlan, launcher: Launcher, options: dict,
              remote_stop: Optional[Callable[[], Optional[str]]] = None,
              spares: Optional[Spares] = None, prepare_next: bool = False) -> Tuple[int, str]:
    """Run one attempt; with ``spares``, its workers may take spares started during the attempt
    before, and (``prepare_next``) spares for the next attempt start `SPARE_DELAY_S` after this one."""
    indices = [process.process_index for process in plan.processes(hosted=False)]
    workers = launcher.workers(plan)
    if spares is not None and prepare_next:
        spares.prepare(workers, delay=SPARE_DELAY_S)
    return run_group_outcome(workers, remote_peers=plan.num_machines > 1, process_indices=indices,
                             remote_stop=remote_stop, spares=spares, **options)


def _launch_together(args: argparse.Namespace, backend: str, launcher: Launcher, options: dict) -> int:
    """Several machines under --max-restarts: every attempt is agreed at machine 0's rendezvous
    (`unified.rendezvous`), which gives it its machines and a fresh port for its group."""
    port = args.main_process_port or 29500
    heartbeat = args.rendezvous_heartbeat_timeout
    key = job_key()  # refused before anything starts: no secret, no rendezvous a stranger cannot steer
    server = None
    if args.machine_rank == 0:
        _refuse_port_in_use(port)
        rendezvous = Rendezvous(args.min_machines, args.num_machines, args.max_restarts, args.rendezvous_last_call,
                                timeout=args.rendezvous_timeout, heartbeat_timeout=heartbeat,
                                pick_port=free_port_everywhere)
        bind = getattr(args, "rendezvous_bind_ip", None) or args.main_process_ip
        server = RendezvousServer(rendezvous, port, key, host=bind).start()
    client = RendezvousClient(_address(args.main_process_ip, port), args.machine_rank, key, patience=heartbeat)
    command = [args.script, *args.script_args]
    try:
        client.join(args.num_processes, patience=args.rendezvous_timeout)  # machine 0 may start later
        while True:
            answer = client.wait_for_attempt(patience=args.rendezvous_timeout)
            if "layout" not in answer:  # over before this machine took part again
                return _final(answer, 0)
            layout = Layout(**answer["layout"])
            rank = layout.rank_of(args.machine_rank)
            sizes = tuple(layout.sizes) if len(set(layout.sizes)) > 1 else ()
            plan = LaunchPlan(backend, args.num_processes, len(layout.machines), rank, args.main_process_ip,
                              layout.port, command, sizes)
            os.environ[RESTART_VARIABLE] = str(layout.attempt)
            if layout.attempt or len(layout.machines) < args.num_machines:
                _note(f"unified launch: attempt {layout.attempt + 1} on {len(layout.machines)} machine(s) "
                      f"({plan.total} processes); this machine is machine {rank}.")
            started = time.monotonic()
            with client.beating(layout.attempt) as beat:
                code, outcome = _run_plan(plan, launcher, options, remote_stop=beat.stop_reason)
            took = time.monotonic() - started
            if beat.lost:  # machine 0 is gone: nobody is left to agree with
                _note(beat.lost)
                return code or 1
            kind = together.FAILED if outcome in RESTARTABLE else together.DONE if outcome == FINISHED else together.LEAVES
            verdict = beat.end(kind, outcome)
            if kind == together.LEAVES or verdict["verdict"] != together.RESTART:
                return _final(verdict, code)
            _note(f"unified launch: restart {layout.attempt + 1} of {args.max_restarts}: attempt "
                  f"{layout.attempt + 1} ended after {took:.1f}s ({verdict['reason']}; here: {outcome}, exit code "
                  f"{code}); joining the next attempt.")
            client.join(args.num_processes)
    except RendezvousLost as err:
        _note(str(err))
        return 1
    except KeyboardInterrupt:  # Ctrl-C while waiting for the other machines (a group running handles it)
        return 128 + signal.SIGINT
    finally:
        if server is not None:
            server.close()


def _address(host: str, port: int) -> str:
    """``host:port`` for a URL (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _final(verdict: Dict[str, str], code: int) -> int:
    """The exit code of a machine whose job is over, with the reason when it is not success."""
    if verdict.get("verdict") == together.FINISHED:
        return code
    if verdict.get("verdict") == together.GAVE_UP:
        _note(f"unified launch: the job gave up: {verdict['reason']}.{see('launch-gave-up')}")
        return code or 1
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    return launch(parse_launch_args(sys.argv[1:] if argv is None else argv))
