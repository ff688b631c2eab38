"""`unified launch`: start N processes of a script as one process group of a backend.

torch: torch's own elastic launcher (torchrun) starts the workers; JAX: a coordinator-based
spawner here starts them with the coordinator address, process count and index in the
environment. Both paths share `run_group`: output prefixed with the process index, the
first failure stops every other process, Ctrl-C stops all of them.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from .backend import backend_names, backend_spec, resolve_backend_name
from .errors import see

__all__ = ["build_parser", "launch", "main"]

GRACE_SECONDS = 10.0
# With several machines, machine 0 keeps services (the JAX coordinator) up this long after its
# own workers ended, so that the other machines' workers can say goodbye to it.
SERVICE_LINGER_SECONDS = 10.0


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="unified launch")
    parser.add_argument("-n", "--num-processes", "--num_processes", type=int, default=1,
                        help="processes per machine (default 1)")
    parser.add_argument("--backend", choices=backend_names(), default=None,
                        help="backend of the group (default: UNIFIED_BACKEND, else the installed one, else torch)")
    parser.add_argument("--main-process-port", "--main_process_port", type=int, default=None,
                        help="port of the rendezvous/coordinator (default: a free port on one machine, 29500 on several)")
    parser.add_argument("--num-machines", "--num_machines", type=int, default=1)
    parser.add_argument("--machine-rank", "--machine_rank", type=int, default=0)
    parser.add_argument("--main-process-ip", "--main_process_ip", default="127.0.0.1",
                        help="address of machine 0 (default 127.0.0.1)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


@dataclass
class Worker:
    """One child process of the launcher and how to label its output."""

    argv: List[str]
    env: Dict[str, str]
    label: Callable[[str], str] = field(default=lambda line: line)
    service: bool = False  # runs until the workers ended (then SIGTERM), its exit is not a result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _validate(args: argparse.Namespace) -> None:
    if args.num_processes < 1:
        raise SystemExit(f"unified launch: --num-processes must be >= 1; received {args.num_processes}." + see("launch-num-processes"))
    if args.num_machines < 1 or not 0 <= args.machine_rank < args.num_machines:
        raise SystemExit(
            f"unified launch: expected 0 <= --machine-rank < --num-machines; received "
            f"--machine-rank {args.machine_rank} with --num-machines {args.num_machines}." + see("launch-machine-rank")
        )
    if not os.path.exists(args.script):
        raise SystemExit(f"unified launch: script not found: {args.script!r}." + see("launch-script-not-found"))


def _base_env(backend: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["UNIFIED_LAUNCHER_BACKEND"] = backend
    env["UNIFIED_BACKEND"] = backend
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torch_workers(args: argparse.Namespace, port: int) -> List[Worker]:
    """One torchrun child that starts this machine's workers; its rank tags are made global."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(args.num_processes),
        "--nnodes", str(args.num_machines),
        "--node-rank", str(args.machine_rank),
        "--master-addr", args.main_process_ip,
        "--master-port", str(port),
        "--tee", "3",
        args.script, *args.script_args,
    ]
    offset = args.machine_rank * args.num_processes
    tag = re.compile(r"\[(?:default|rank)(\d+)\]:")

    def label(line: str) -> str:
        match = tag.match(line)
        if not match:
            return f"[launcher] {line}"
        # torchrun tags every fragment it copies, so tags can also stand after a "\r" mid-line
        return tag.sub(lambda m: f"[{offset + int(m.group(1))}] ", line)

    return [Worker(argv, _base_env("torch"), label)]


def env_workers(backend: str, args: argparse.Namespace, port: int, service: Optional[str]) -> List[Worker]:
    """N children with the UNIFIED_* process-group variables; machine 0 also runs the backend's
    service, if it has one, in a child of its own (JAX: backends/jax_coordinator.py)."""
    total = args.num_processes * args.num_machines
    address = f"{args.main_process_ip}:{port}"
    workers = []
    if args.machine_rank == 0 and service:
        workers.append(Worker([sys.executable, "-m", service, address, str(total)],
                              {**_base_env(backend), "TF_CPP_MIN_LOG_LEVEL": "2"},
                              lambda line: f"[{service}] {line}", service=True))
    for local in range(args.num_processes):
        index = args.machine_rank * args.num_processes + local
        env = _base_env(backend)
        env.update(
            UNIFIED_COORDINATOR_ADDRESS=address,
            UNIFIED_COORDINATOR_HOSTED="1" if service else "0",
            UNIFIED_NUM_PROCESSES=str(total),
            UNIFIED_PROCESS_ID=str(index),
            UNIFIED_LOCAL_PROCESS_ID=str(local),
            UNIFIED_LOCAL_NUM_PROCESSES=str(args.num_processes),
        )
        workers.append(Worker([sys.executable, args.script, *args.script_args], env,
                              lambda line, i=index: f"[{i}] {line}"))
    return workers



def _pump(stream, label: Callable[[str], str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        # progress bars redraw with "\r": label every redrawn fragment, not only the first
        text = "\r".join(label(part) if part else part for part in line.split("\r"))
        with lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
    stream.close()


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _stop_all(procs: Sequence[subprocess.Popen], first: int = signal.SIGTERM) -> None:
    _signal_all(procs, first)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    _signal_all(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_group(workers: Sequence[Worker], remote_peers: bool = False) -> int:
    """Run the workers to completion; the first failure stops the rest. Returns the exit code."""
    lock = threading.Lock()
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    interrupted: List[int] = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for worker in workers:
            proc = subprocess.Popen(worker.argv, env=worker.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc.stdout, worker.label, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        mains = [p for p, w in zip(procs, workers) if not w.service]
        code = 0
        while True:
            if interrupted:
                _stop_all(procs, signal.SIGINT if interrupted[0] == signal.SIGINT else signal.SIGTERM)
                code = 130 if interrupted[0] == signal.SIGINT else 143
                break
            codes = [p.poll() for p in mains]
            failed = [c for c in codes if c not in (None, 0)]
            failed += [p.returncode or 1 for p, w in zip(procs, workers) if w.service and p.poll() is not None]
            if failed:
                code = failed[0] if failed[0] > 0 else 128 - failed[0]
                _stop_all(procs)
                break
            if all(c == 0 for c in codes):
                time.sleep(SERVICE_LINGER_SECONDS if len(mains) < len(procs) and remote_peers else 0)
                _stop_all(procs)
                break
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for pump in pumps:
        pump.join(timeout=5)
    if code:
        sys.stderr.write(f"unified launch: a process failed (exit code {code}); stopped the others.{see('launch-process-failed')}\n")
    return code


def launch(args: argparse.Namespace) -> int:
    """Start the group described by parsed ``args``; returns the exit code."""
    _validate(args)
    backend = resolve_backend_name(args.backend)
    port = args.main_process_port
    if port is None:
        port = free_port() if args.num_machines == 1 else 29500
    spec = backend_spec(backend)
    if spec.launcher == "torchrun":
        workers = torch_workers(args, port)
    else:
        workers = env_workers(backend, args, port, spec.service)
    return run_group(workers, remote_peers=args.num_machines > 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return launch(build_parser().parse_args(argv))
