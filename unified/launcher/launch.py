"""`unified launch`: start N processes of a script as one process group of a backend, on each
machine, and start it again under ``--max-restarts``.

The command line (`build_parser`, `parse_launch_args`: what comes after the script's path is the
script's), its checks, and the attempts: one after the other on one machine (the next attempt's
workers taken from `processes.Spares`), or agreed with every other machine at machine 0's
`rendezvous` (several machines with ``--max-restarts``). Each attempt runs a `plan.LaunchPlan`
through `processes.run_group_outcome`.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..backend.registry import backend_names, backend_spec, load_object, resolve_backend_name
from ..errors import see
from ..runtime.environment import RESTART_VARIABLE, RUN_VARIABLE, run_identity
from ..runtime.preemption import SIGNALS_VARIABLE, resolve_preemption_signals, signal_names
from ..training.loop import PRECISION_VARIABLE, PRECISIONS
from . import rendezvous as together
from .job_secret import SECRET_VARIABLE, job_key
from .plan import VERBOSE_VARIABLE, Launcher, LaunchPlan
from .processes import FINISHED, GRACE_PERIOD_SECONDS, RESTARTABLE, Spares, note, run_group_outcome
from .rendezvous import (
    BEAT_S,
    HEARTBEAT_TIMEOUT_S,
    MIN_HEARTBEAT_TIMEOUT_S,
    Layout,
    Rendezvous,
    RendezvousClient,
    RendezvousLost,
    RendezvousServer,
    free_port_everywhere,
)

__all__ = ["build_parser", "parse_launch_args", "launch", "main", "free_port"]

# --max-restarts: the next attempt's spares start this long after an attempt (its own start-up first)
SPARE_DELAY_S = 3.0


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="unified launch", allow_abbrev=False)
    parser.add_argument("-n", "--num-processes", "--num_processes", type=int, default=1,
                        help="processes per machine (default 1)")
    parser.add_argument("--backend", choices=backend_names(), default=None,
                        help="backend of the group (default: UNIFIED_BACKEND, else the installed one, else torch)")
    parser.add_argument("--main-process-port", "--main_process_port", type=int, default=None,
                        help="port of the rendezvous/coordinator (default: a free port on one machine, 29500 on "
                             "several)")
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
                        help="arguments for the script: everything after its path is the script's, never the "
                             "launcher's")
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
        raise SystemExit(f"unified launch: --num-processes must be >= 1; received {args.num_processes}."
                         + see("launch-num-processes"))
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
        raise SystemExit(f"unified launch: --max-restarts must be >= 0; received {args.max_restarts}."
                         + see("launch-max-restarts"))
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
            note(f"unified launch: attempt {attempt + 1} ended too ({outcome}, exit code {code}, after {took:.1f}s); "
                  f"gave up after {max_restarts} restart(s).{see('launch-gave-up')}")
            return code
        attempt += 1
        note(f"unified launch: restart {attempt} of {max_restarts}: attempt {attempt} ended after {took:.1f}s "
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
    (`unified.launcher.rendezvous`), which gives it its machines and a fresh port for its group."""
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
                note(f"unified launch: attempt {layout.attempt + 1} on {len(layout.machines)} machine(s) "
                      f"({plan.total} processes); this machine is machine {rank}.")
            started = time.monotonic()
            with client.beating(layout.attempt) as beat:
                code, outcome = _run_plan(plan, launcher, options, remote_stop=beat.stop_reason)
            took = time.monotonic() - started
            if beat.lost:  # machine 0 is gone: nobody is left to agree with
                note(beat.lost)
                return code or 1
            kind = (together.FAILED if outcome in RESTARTABLE
                    else together.DONE if outcome == FINISHED else together.LEAVES)
            verdict = beat.end(kind, outcome)
            if kind == together.LEAVES or verdict["verdict"] != together.RESTART:
                return _final(verdict, code)
            note(f"unified launch: restart {layout.attempt + 1} of {args.max_restarts}: attempt "
                  f"{layout.attempt + 1} ended after {took:.1f}s ({verdict['reason']}; here: {outcome}, exit code "
                  f"{code}); joining the next attempt.")
            client.join(args.num_processes)
    except RendezvousLost as err:
        note(str(err))
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
        note(f"unified launch: the job gave up: {verdict['reason']}.{see('launch-gave-up')}")
        return code or 1
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    return launch(parse_launch_args(sys.argv[1:] if argv is None else argv))
