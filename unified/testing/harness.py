"""Run scenario functions in a real process group of fresh interpreters and collect results.

Each process runs `unified.testing.worker`, which executes the scenarios in order and writes
one JSON result file per process; the parent asserts across processes, reading results by
scenario. The group joins as the backend's launcher makes its workers join (`Launcher.process_env`,
and its rendezvous service from `Launcher.service_argv` in a process of its own). Every run has
a deadline; on any failure the per-process logs are shown.

Example (in a test)::

    from unified.testing.harness import run_group
    from unified.testing.scenarios import start, identity

    group = run_group("torch", 2, [start, identity], tmp_path)
    assert [r["process_index"] for r in group.scenario(identity)] == [0, 1]
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from unified.environment import ProcessEnvironment
from unified.launch import Launcher, free_port, stop_processes
from unified.registry import backend_spec, load_object

from .scenario import missing_requirements, reference, requirements

WORKER = [sys.executable, "-m", "unified.testing.worker"]


def _name(function: Union[Callable, str]) -> str:
    """A scenario's key in the results: its function's name (or the name itself)."""
    return function if isinstance(function, str) else function.__name__


def _launcher(backend: str) -> Launcher:
    return load_object(backend_spec(backend).launcher)


def group_env(backend: str, rank: int, size: int, port: int, local_rank: int, local_size: int) -> Dict[str, str]:
    """The variables the backend's own launcher gives process ``rank`` of a ``size``-process
    group whose rendezvous service (`service_command`) listens on ``port``."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", UNIFIED_BACKEND=backend)
    if size == 1:
        return env
    process = ProcessEnvironment(rank, size, local_rank, local_size, coordinator=f"127.0.0.1:{port}", service_hosted=True)
    env.update(_launcher(backend).process_env(process))
    return env


def service_command(backend: str, size: int, port: int) -> Optional[List[str]]:
    """The backend's rendezvous service, hosted outside the workers as `unified launch` does."""
    return _launcher(backend).service_argv(f"127.0.0.1:{port}", size)


@dataclass
class GroupResult:
    """What one group left: each process's results (read them by scenario), exit code, log and
    exit time, and the scenarios it did not run for lack of a capability.

    Example:
        >>> group = run_group("jax", 3, [start, identity], tmp_path).ok()   # doctest: +SKIP
        >>> [r["process_index"] for r in group.scenario(identity)]           # doctest: +SKIP
        [0, 1, 2]
    """

    results: List[dict]        # one dict per process: scenario name -> returned value
    returncodes: List[Optional[int]]
    logs: List[str]
    elapsed: float
    exit_times: List[Optional[float]]  # wall-clock time each process exited (None: killed at the deadline)
    not_run: Dict[str, str] = field(default_factory=dict)  # scenario name -> the capability it lacks
    backend: str = ""
    size: int = 0
    shared: Optional[Path] = None  # the folder the scenarios share (UNIFIED_TEST_SHARED)

    def ok(self) -> "GroupResult":
        """This result, after checking that every process exited with 0 (else: every log)."""
        assert all(rc == 0 for rc in self.returncodes), self.show_logs()
        return self

    def show_logs(self) -> str:
        return "\n".join(
            f"----- process {i} (exit code {rc}) -----\n{log}" for i, (rc, log) in enumerate(zip(self.returncodes, self.logs))
        )

    def result(self, rank: int, function: Union[Callable, str]) -> Optional[Any]:
        """Process ``rank``'s result of one scenario; ``None`` when it reported none (it died)."""
        return self.results[rank].get(_name(function))

    def scenario(self, function: Union[Callable, str]) -> List[dict]:
        """Every process's result of one scenario (the function, or its name); fails with the
        logs when one is missing, and skips the calling test when the backend cannot run it."""
        name = _name(function)
        if name in self.not_run:
            import pytest

            pytest.skip(self.not_run[name])
        values = []
        for rank, result in enumerate(self.results):
            if name not in result:
                raise AssertionError(f"process {rank} did not report scenario {name!r}\n{self.show_logs()}")
            if isinstance(result[name], dict) and "error" in result[name] and result[name].get("unexpected"):
                raise AssertionError(f"process {rank} failed in {name!r}: {result[name]['error']}\n{self.show_logs()}")
            values.append(result[name])
        return values


class Runs:
    """The results of several groups, read by scenario (from the group that ran it).

    Example:
        >>> runs = Runs(first, second)          # doctest: +SKIP
        >>> runs.scenario(ckpt_resume_run)       # doctest: +SKIP
    """

    def __init__(self, *groups: GroupResult) -> None:
        self.groups = groups

    def scenario(self, function: Union[Callable, str]) -> List[dict]:
        name = _name(function)
        for group in self.groups:
            if name in group.not_run or any(name in result for result in group.results):
                return group.scenario(function)
        raise AssertionError(f"no group ran scenario {name!r}\n" + "\n".join(g.show_logs() for g in self.groups))


def run_group(backend: str, size: int, scenarios: Sequence[Callable], tmp_path: Path, *,
              deadline: float = 120.0, local_sizes: Optional[Sequence[int]] = None,
              extra_env: Optional[Dict[str, str]] = None,
              kill_when: Optional[Path] = None, kill_delay: float = 0.0) -> GroupResult:
    """Run ``scenarios`` (functions decorated with `unified.testing.scenario`) in ``size`` fresh
    processes of ``backend``; never longer than ``deadline``. Scenarios the backend lacks a
    capability for are left out (`GroupResult.not_run`).

    ``tmp_path`` holds the group's logs and results and is the folder the scenarios share
    (``UNIFIED_TEST_SHARED``, unless ``extra_env`` names another).
    ``local_sizes`` splits the processes into simulated machines (e.g. ``[2, 1]``).
    ``kill_when``: once this file exists, wait ``kill_delay`` seconds and SIGKILL every process
    of the group at once (a crash of the whole job).
    """
    local_sizes = list(local_sizes or [size])
    assert sum(local_sizes) == size
    for function in scenarios:
        sizes = requirements(function).processes
        if sizes is not None and size not in sizes:
            raise ValueError(f"scenario {function.__name__} is written for groups of {sizes} processes, not {size}")
    not_run = missing_requirements(backend, scenarios)
    targets = [reference(f) for f in scenarios if f.__name__ not in not_run]
    if not targets:  # nothing this backend can run: no processes (reading a result skips the test)
        return GroupResult([{} for _ in range(size)], [0] * size, [""] * size, 0.0, [None] * size, not_run, backend,
                           size, Path(tmp_path))
    out = tmp_path / f"{backend}-{size}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    port = free_port()
    procs, logs = [], []
    service = None
    command = service_command(backend, size, port) if size > 1 else None
    if command:  # as `unified launch` / torchrun do: the rendezvous service outlives every worker
        service = subprocess.Popen(command, env=group_env(backend, 0, 1, port, 0, 1), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True, cwd=str(out))
    rank = 0
    for machine_size in local_sizes:
        for local in range(machine_size):
            env = group_env(backend, rank, size, port, local, machine_size)
            env["UNIFIED_TEST_SHARED"] = str(tmp_path)
            env.update(extra_env or {})
            env["UNIFIED_TEST_OUT"] = str(out / f"result_{rank}.json")
            log = open(out / f"log_{rank}.txt", "wb")
            logs.append(log)
            procs.append(subprocess.Popen([*WORKER, *targets], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, cwd=str(out)))
            rank += 1
    start = time.monotonic()
    exit_times: List[Optional[float]] = [None] * size
    kill_at: Optional[float] = None
    while time.monotonic() - start < deadline and any(t is None for t in exit_times):
        if kill_when is not None and kill_at is None and kill_when.exists():
            kill_at = time.monotonic() + kill_delay
        if kill_at is not None and time.monotonic() >= kill_at:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            kill_at = float("inf")
        for i, proc in enumerate(procs):
            if exit_times[i] is None and proc.poll() is not None:
                exit_times[i] = time.time()
        time.sleep(0.02)
    stop_processes(procs)  # the launcher's escalation: SIGTERM, SIGKILL after its grace; our own process groups only
    elapsed = time.monotonic() - start
    if service is not None:
        stop_processes([service], first=signal.SIGKILL)
    for log in logs:
        log.close()
    results = []
    for r in range(size):
        path = out / f"result_{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return GroupResult(results, [p.returncode for p in procs],
                       [(out / f"log_{r}.txt").read_text(errors="replace") for r in range(size)], elapsed,
                       exit_times, not_run, backend, size, Path(tmp_path))
